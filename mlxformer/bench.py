"""``mlxformer bench``: prefill and decode throughput and peak memory on random prompts."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import mlx.core as mx

from .cache import CacheSettings, make_cache
from .cli import add_cache_args, add_model_args, cache_settings, load_for_cli
from .errors import MlxformerError
from .generate import generate_tokens
from .model import Model
from .sampling import greedy

# A token stream: given a prompt (T,) and a count, yields that many generated token ids.
TokenLoop = Callable[[mx.array, int], Iterator[int]]


@dataclass(frozen=True)
class Trial:
    """One measured generation: prefill and decode throughput, peak memory."""

    prompt_tokens: int
    generation_tokens: int
    prefill_tps: float
    decode_tps: float
    peak_memory_gb: float


def measure(token_loop: TokenLoop, prompt: mx.array, generation_tokens: int) -> Trial:
    """Time ``token_loop``: prefill = time to the first token, decode = the rest per token."""
    mx.synchronize()
    mx.reset_peak_memory()
    start = time.perf_counter()
    first = start
    count = 0
    for count, _ in enumerate(token_loop(prompt, generation_tokens), start=1):
        if count == 1:
            first = time.perf_counter()
    end = time.perf_counter()
    return Trial(
        prompt_tokens=prompt.size,
        generation_tokens=count,
        prefill_tps=prompt.size / (first - start),
        decode_tps=(count - 1) / (end - first) if count > 1 else 0.0,
        peak_memory_gb=mx.get_peak_memory() / 1e9,
    )


def mlxformer_loop(model: Model, settings: CacheSettings | None = None) -> TokenLoop:
    """mlxformer's greedy generation loop over a fresh cache (eos is not checked)."""

    def loop(prompt: mx.array, n: int) -> Iterator[int]:
        cache = make_cache(model, settings)
        return generate_tokens(model, prompt, cache, greedy, (), n)

    return loop


def random_prompt(vocab_size: int, length: int, seed: int = 0) -> mx.array:
    """A reproducible random prompt of ``length`` token ids."""
    return mx.random.randint(0, vocab_size, (length,), key=mx.random.key(seed))


def median_trial(trials: list[Trial]) -> Trial:
    """Field-wise median of several trials."""
    return Trial(
        prompt_tokens=trials[0].prompt_tokens,
        generation_tokens=trials[0].generation_tokens,
        prefill_tps=statistics.median(t.prefill_tps for t in trials),
        decode_tps=statistics.median(t.decode_tps for t in trials),
        peak_memory_gb=statistics.median(t.peak_memory_gb for t in trials),
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``bench`` subcommand."""
    parser = subparsers.add_parser("bench", help="measure prefill/decode speed and peak memory")
    add_model_args(parser)
    parser.add_argument("--prompt-tokens", type=int, default=512, help="random prompt length (default 512)")
    parser.add_argument("--generation-tokens", type=int, default=128, help="tokens to generate (default 128)")
    parser.add_argument("--trials", type=int, default=3, help="number of trials (default 3)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_cache_args(parser)
    parser.add_argument("--verbose", "-v", action="store_true", dest="verbose_sub", help="show tracebacks")
    parser.set_defaults(handler=run)


def _line(name: str, trial: Trial) -> str:
    return (
        f"{name:>7}: prefill {trial.prefill_tps:8.1f} tok/s | decode {trial.decode_tps:7.2f} tok/s | "
        f"peak memory {trial.peak_memory_gb:.3f} GB"
    )


def run(args: argparse.Namespace) -> int:
    if args.prompt_tokens < 1 or args.generation_tokens < 2 or args.trials < 1:
        raise MlxformerError("need --prompt-tokens >= 1, --generation-tokens >= 2 and --trials >= 1")
    settings = cache_settings(args)
    model, _ = load_for_cli(args)
    loop = mlxformer_loop(model, settings)
    prompt = random_prompt(model.args.vocab_size, args.prompt_tokens)
    measure(loop, prompt[:16], 4)  # warm-up
    trials = []
    for i in range(args.trials):
        trials.append(measure(loop, prompt, args.generation_tokens))
        if not args.json:
            print(_line(f"trial {i + 1}", trials[-1]), flush=True)
    median = median_trial(trials)
    if args.json:
        print(json.dumps({"trials": [asdict(t) for t in trials], "median": asdict(median)}, indent=2))
    else:
        print(_line("median", median))
    return 0
