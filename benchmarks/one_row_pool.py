"""A single stream decoding on a one-row pool's views beside its own caches (issue 40: "a single
stream is a pool with one row"): whether the tokens and logits agree bit for bit, and the decode
speed of each, trials interleaved (own, pool, pool, own, ...) on the same model in one process.

The pool is the engine's (``BatchRunner.seat``: a row of ``cache/pool.py``'s ``KVPool``,
each layer a ``RowCache`` view, which records what a forward wrote once it is built); the own caches
are ``make_cache``'s, as ``generate`` uses them. Greedy decoding of ``--tokens`` tokens after a
short prompt; ``--kv-bits`` quantizes both (from the first token); ``--max-kv-size`` makes both
rotating.

    python benchmarks/one_row_pool.py --model .bench/models/smollm2-f32 --tokens 64 --trials 3
    python benchmarks/one_row_pool.py --model .bench/models/smollm2-f32 --kv-bits 8
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx

from mlxformer import load
from mlxformer.cache import Cache, CacheSettings, make_cache
from mlxformer.engine.batch_runner import BatchRunner

PROMPT = "Write a long story about the sea, the waves and the boats that sail on it."


class Stream:
    """What ``BatchRunner.seat`` needs of a sequence."""

    speculator = None
    adapters = None

    def __init__(self, cache: list[Cache]) -> None:
        self.cache = cache


def decode(model, prompt: mx.array, settings: CacheSettings, tokens: int, pooled: bool) -> tuple[list[int], mx.array, float]:
    """Greedy ``tokens`` after ``prompt`` on own caches or on a one-row pool: the tokens, the
    last logits and the decode tokens/s (the prompt's forward not timed)."""
    stream = Stream(make_cache(model, settings))
    if pooled:
        runner = BatchRunner(model)
        runner.prefill_chunk = prompt.shape[1]
        runner.seat(stream)  # the stream's caches are now views of its row
    logits = model(prompt, stream.cache)[:, -1]
    mx.eval(logits)
    out, start = [], time.perf_counter()
    for _ in range(tokens):
        token = mx.argmax(logits, axis=-1)
        logits = model(token[:, None], stream.cache)[:, -1]
        mx.eval(logits)
        out.append(int(token.item()))
    return out, logits, tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path(".bench/models/smollm2-f32"))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--kv-bits", type=int, default=None)
    parser.add_argument("--max-kv-size", type=int, default=None)
    args = parser.parse_args()
    model, tokenizer = load(str(args.model))
    settings = CacheSettings(kv_bits=args.kv_bits, max_kv_size=args.max_kv_size)
    prompt = mx.array(tokenizer.encode(PROMPT))[None]
    speeds: dict[bool, list[float]] = {False: [], True: []}
    results = {}
    for trial in range(args.trials):
        for pooled in ((False, True) if trial % 2 == 0 else (True, False)):
            tokens, logits, speed = decode(model, prompt, settings, args.tokens, pooled)
            speeds[pooled].append(speed)
            results[pooled] = (tokens, logits)
    same = results[False][0] == results[True][0]
    diff = float(mx.abs(results[False][1] - results[True][1]).max())
    own, pool = statistics.median(speeds[False]), statistics.median(speeds[True])
    print(f"{args.model.name}, KV {settings.kv_bits or 'float'}, max_kv_size {settings.max_kv_size}, "
          f"{args.tokens} tokens, median of {args.trials}")
    print(f"same tokens: {same}; largest last-logit difference: {diff:g}")
    print(f"decode: own caches {own:.2f} tok/s, one-row pool {pool:.2f} tok/s, pool / own {pool / own:.2f}")


if __name__ == "__main__":
    main()
