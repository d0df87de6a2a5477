"""``mlxformer generate``: stream a completion to stdout, statistics to stderr."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from mlxformer.cli.common import (
    add_cache_args, add_model_args, add_prompt_args, add_sampling_args, add_verbose, cache_settings, load_for_cli,
    prompt_ids_for_cli, read_prompt, sampling_settings,
)

if TYPE_CHECKING:
    from mlxformer.generation import GenerationResponse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``generate`` subcommand."""
    parser = subparsers.add_parser("generate", help="generate text from a prompt")
    add_model_args(parser)
    add_prompt_args(parser)
    add_sampling_args(parser)
    add_cache_args(parser)
    parser.add_argument("--prompt-cache-file", help="continue from a cache saved by 'mlxformer cache-prompt'")
    add_verbose(parser)
    parser.set_defaults(handler=run)


def format_stats(response: GenerationResponse) -> str:
    """One stats line for stderr."""
    return (
        f"prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.1f} tok/s | "
        f"generation: {response.generation_tokens} tokens, {response.generation_tps:.1f} tok/s | "
        f"peak memory: {response.peak_memory_gb:.3f} GB"
    )


def run(args: argparse.Namespace) -> int:
    """Handler of ``mlxformer generate``."""
    from mlxformer.generation import stream_generate

    prompt = read_prompt(args.prompt)
    sampling = sampling_settings(args)
    settings = cache_settings(args)
    model, tokenizer = load_for_cli(args)
    ids = prompt_ids_for_cli(tokenizer, prompt, args)
    cache = None
    if args.prompt_cache_file:
        from mlxformer.cache.files import load_prompt_cache, strip_cached_prefix

        cache, cached_ids = load_prompt_cache(args.prompt_cache_file, model, tokenizer, settings)
        ids = strip_cached_prefix(ids, cached_ids)
    last = None
    for last in stream_generate(
        model, tokenizer, ids, args.max_tokens, sampling=sampling, stop=args.stop, cache=cache, cache_settings=settings
    ):
        sys.stdout.write(last.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if last is not None:
        print(format_stats(last), file=sys.stderr)
    return 0
