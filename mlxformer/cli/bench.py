"""``mlxformer bench``: prefill and decode throughput and peak memory on random prompts."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING

from mlxformer.cli.common import (
    add_cache_args, add_model_args, add_speculative_args, add_verbose, cache_settings, load_for_cli, speculative_settings,
)

if TYPE_CHECKING:
    from mlxformer.tools.bench import Trial


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``bench`` subcommand."""
    parser = subparsers.add_parser("bench", help="measure prefill/decode speed and peak memory")
    add_model_args(parser)
    parser.add_argument("--prompt-tokens", type=int, default=512, help="random prompt length (default 512)")
    parser.add_argument("--generation-tokens", type=int, default=128, help="tokens to generate (default 128)")
    parser.add_argument("--trials", type=int, default=3, help="number of trials (default 3)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_cache_args(parser)
    add_speculative_args(parser)
    add_verbose(parser)
    parser.set_defaults(handler=run)


def _line(name: str, trial: Trial) -> str:
    line = (
        f"{name:>7}: prefill {trial.prefill_tps:8.1f} tok/s | decode {trial.decode_tps:7.2f} tok/s | "
        f"peak memory {trial.peak_memory_gb:.3f} GB"
    )
    if trial.proposed_tokens:
        line += f" | accepted {trial.accepted_tokens}/{trial.proposed_tokens} proposed"
    return line


def run(args: argparse.Namespace) -> int:
    """Handler of ``mlxformer bench``."""
    from mlxformer.tools.bench import run_benchmark
    from mlxformer.default_model import model_source
    from mlxformer.errors import MlxformerError

    if args.prompt_tokens < 1 or args.generation_tokens < 2 or args.trials < 1:
        raise MlxformerError("need --prompt-tokens >= 1, --generation-tokens >= 2 and --trials >= 1")
    settings = cache_settings(args)

    def progress(message: str) -> None:  # on stderr: stdout holds the results (or the JSON)
        print(f"mlxformer: {message}", file=sys.stderr, flush=True)

    progress(f"loading {model_source(args.model)}")
    model, tokenizer = load_for_cli(args)
    speculative = speculative_settings(args, tokenizer, model)
    count = iter(range(1, args.trials + 1))

    def show(trial: Trial) -> None:
        if not args.json:
            print(_line(f"trial {next(count)}", trial), flush=True)

    trials, median = run_benchmark(
        model, settings, args.prompt_tokens, args.generation_tokens, args.trials, show, speculative, tokenizer,
        on_progress=progress,
    )
    if args.json:
        print(json.dumps({"trials": [asdict(t) for t in trials], "median": asdict(median)}, indent=2))
    else:
        print(_line("median", median))
    return 0
