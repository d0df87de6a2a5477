"""Thread hand-offs per decoded token: voluntary context switches of every thread of this process
(Linux ``/proc``), for mlxformer's ``stream_generate``, its ``Engine`` (one request) and
mlx-lm's ``stream_generate``, with the projections on 1 and on 2 CPU streams.

A voluntary switch is a thread going to sleep until another wakes it (MLX's stream worker
waiting for work, the evaluating thread waiting for the worker). Each one costs a wake-up, which
on a busy machine waits for a time slice: the count is what makes a step slower under load
than its CPU time says. The counts vary with timing (up to 2x between runs on a busy machine:
a worker that finds work queued does not sleep), so compare them within one run
(docs/design/server.md, section 3).

Usage: python benchmarks/handoffs.py [--model .bench/models/tiny-smollm2] [--tokens 64]
"""

from __future__ import annotations

import argparse
import glob
import os
from typing import Iterable

from serving import load_average


def switches() -> int:
    """Voluntary context switches so far, summed over this process's threads."""
    total = 0
    for status in glob.glob(f"/proc/{os.getpid()}/task/*/status"):
        try:
            with open(status) as lines:
                total += next(int(line.split()[1]) for line in lines if line.startswith("voluntary_ctxt_switches"))
        except (FileNotFoundError, StopIteration):  # a thread that ended meanwhile
            pass
    return total


def per_token(stream: Iterable[object]) -> float:
    """Switches per item of ``stream`` after its first (prefill excluded)."""
    count, start = 0, 0
    for _ in stream:
        count += 1
        if count == 1:
            start = switches()
    return (switches() - start) / max(1, count - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=".bench/models/tiny-smollm2")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    import mlx_lm

    from mlxformer import load, stream_generate
    from mlxformer.engine import Engine
    from mlxformer.engine.request_state import GenerationRequest

    print(f"load average {load_average()}")
    for threads in (1, 2):
        model, tokenizer = load(args.model, threads=threads)
        ids = tokenizer.encode_prompt("Write a long story about the sea.")
        list(stream_generate(model, tokenizer, ids, 4))
        library = per_token(stream_generate(model, tokenizer, ids, args.tokens))
        with Engine(model, tokenizer) as engine:
            list(engine.submit(GenerationRequest(prompt_ids=ids, max_tokens=4)))
            engine_switches = per_token(engine.submit(GenerationRequest(prompt_ids=ids, max_tokens=args.tokens)))
        print(f"threads={threads}: stream_generate {library:.1f}, engine {engine_switches:.1f} switches per token", flush=True)
    model, tokenizer = mlx_lm.load(args.model)
    list(mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=4))
    print(f"mlx-lm stream_generate: {per_token(mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=args.tokens)):.1f}")
    print(f"load average {load_average()}")


if __name__ == "__main__":
    main()
