"""Engine overlap (issue 32): the wall time of decode-only engine steps with the overlap on
(step n+1 queued with ``mx.async_eval`` before step n's tokens are read and handed out) and off
(each step's tokens read at its end), interleaved runs of the same requests. Greedy, in process.

    python benchmarks/overlap.py [--model PATH | --tiny DIR] [--clients 4] [--max-tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import mlx.core as mx

from mlxformer import load
from mlxformer.default_model import default_model_path
from mlxformer.engine import Engine, GenerationRequest

PROMPTS = ["hello world", "once upon a time", "good morning", "lorem ipsum", "the cat sat", "a b c d", "x y", "zz"]


def run(engine: Engine, requests: list[GenerationRequest], overlap: bool) -> list[float]:
    """The decode-only steps' wall times (s) of one run of ``requests``, all submitted at once."""
    engine.overlap = overlap
    times: list[float] = []
    real_step, real_run = engine.step, engine._run
    decode_only: list[bool] = []

    def run_step(step) -> None:  # type: ignore[no-untyped-def]
        decode_only.append(bool(step.decode) and not step.prefill)
        real_run(step)

    def step() -> None:
        decode_only.clear()
        start = time.perf_counter()
        real_step()
        if decode_only and decode_only[0]:
            times.append(time.perf_counter() - start)

    engine._run, engine.step = run_step, step  # type: ignore[method-assign]
    try:
        with engine._wake:  # they arrive together (the idle loop waits on it)
            handles = [engine.submit(r) for r in requests]
        outputs = [[e.token for e in h] for h in handles]
    finally:
        engine._run, engine.step = real_run, real_step  # type: ignore[method-assign]
    run.outputs = outputs  # type: ignore[attr-defined]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the offline SmolLM2-135M Q4_1 GGUF")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model, tokenizer = load(args.model or default_model_path(), dtype=mx.float32)
    tokenizer.eos_token_ids = []  # every request decodes max_tokens
    requests = [GenerationRequest(tokenizer.encode(PROMPTS[i % len(PROMPTS)]), args.max_tokens)
                for i in range(args.clients)]
    results: dict[bool, list[float]] = {True: [], False: []}
    outputs: dict[bool, list] = {}
    with Engine(model, tokenizer, max_batch=args.clients, prefix_cache_bytes=0) as engine:
        run(engine, requests[:1], True)  # warm up
        for _ in range(args.rounds):
            for overlap in (False, True):
                results[overlap] += run(engine, requests, overlap)
                outputs[overlap] = run.outputs  # type: ignore[attr-defined]
    assert outputs[True] == outputs[False], "the overlap changed the tokens"
    print(f"model {args.model or default_model_path()}, {args.clients} clients, {args.max_tokens} tokens, "
          f"load average {os.getloadavg()[0]:.1f}")
    for overlap in (False, True):
        t = sorted(results[overlap])
        print(f"overlap {'on ' if overlap else 'off'}: {len(t)} decode steps, median {statistics.median(t) * 1e3:.2f} ms, "
              f"fastest {t[0] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
