"""Aggregate decode throughput of the continuous-batching engine at 1/4/8 concurrent sequences,
against single-stream ``generate`` and mlx-lm (``stream_generate`` and its ``batch_generate``)
on the same model files, interleaved round by round.

Every sequence generates exactly ``--tokens`` tokens (EOS is banned through ``logit_bias`` in
the engine; mlx-lm's batch gets the same ``--tokens`` and stops only at EOS, which the prompts
rarely reach). Reported per row: aggregate generated tokens/s over the whole run (prefill
included, as a server sees it), and the steady decode rate (tokens generated once every
sequence is decoding / that time), each with its ratio to mlxformer's single-stream decode.

Usage: python benchmarks/engine_throughput.py [--model .bench/models/smollm2-f32] [--tokens 48]
       [--clients 1 4 8] [--rounds 2] [--kv-bits 8] [--no-mlx-lm]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one core for numpy's BLAS, as MLX's matmul uses

import argparse
import statistics
import threading
import time
from pathlib import Path

PROMPTS = [
    "Write a long story about a dragon who learns to cook.",
    "Explain in detail how a steam engine works.",
    "List the planets of the solar system and describe each one.",
    "Describe a walk through a busy market in Marrakesh.",
    "What are the main causes of the French Revolution? Explain each.",
    "Write a letter to a friend about your summer holidays.",
    "Explain recursion to a beginner programmer with examples.",
    "Describe the life cycle of a butterfly step by step.",
]


def single_stream(model, tokenizer, ids: list[int], tokens: int) -> float:
    """mlxformer's single-stream decode tokens/s."""
    from mlxformer.generation.stream import stream_generate

    last = None
    for last in stream_generate(model, tokenizer, ids, tokens):
        pass
    return last.generation_tps


def engine_run(engine, prompts: list[list[int]], tokens: int, eos: list[int]) -> tuple[float, float]:
    """(aggregate tokens/s over the run, steady decode tokens/s once all sequences decode)."""
    from mlxformer.engine import GenerationRequest
    from mlxformer.sampling.options import SamplingSettings

    sampling = SamplingSettings(logit_bias={t: -100.0 for t in eos})
    stamps: list[list[float]] = [[] for _ in prompts]
    start = time.perf_counter()
    handles = [engine.submit(GenerationRequest(p, max_tokens=tokens, sampling=sampling)) for p in prompts]

    def consume(i: int) -> None:
        for _ in handles[i]:
            stamps[i].append(time.perf_counter())

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    end = max(s[-1] for s in stamps)
    total = sum(len(s) for s in stamps)
    all_decoding = max(s[0] for s in stamps)
    steady = sum(1 for s in stamps for x in s if x > all_decoding)
    return total / (end - start), steady / max(end - all_decoding, 1e-9)


def mlx_lm_single(model, tokenizer, ids: list[int], tokens: int) -> float:
    from mlx_lm.generate import stream_generate

    last = None
    for last in stream_generate(model, tokenizer, ids, max_tokens=tokens):
        pass
    return last.generation_tps


def mlx_lm_batch(model, tokenizer, prompts: list[list[int]], tokens: int) -> float:
    from mlx_lm.generate import batch_generate

    start = time.perf_counter()
    response = batch_generate(model, tokenizer, prompts, max_tokens=tokens, return_token_ids=True)
    elapsed = time.perf_counter() - start
    return sum(len(t) for t in response.token_ids) / elapsed


def matmul_scaling(model, rows: tuple[int, ...] = (1, 4, 8), repeats: int = 20) -> list[str]:
    """Time one decoder MLP projection for ``rows`` token rows, in MLX and in numpy (OpenBLAS):
    batching pays only if a matmul over 8 rows costs well under 8 single-row ones."""
    import mlx.core as mx
    import numpy as np

    weight = model.layers[0].mlp.gate_proj.weight.astype(mx.float32)  # (out, in)
    w_t = mx.contiguous(weight.T)
    mx.eval(w_t)
    w_np = np.array(w_t)
    lines = []

    def fastest(run) -> float:  # the minimum over repeats: the least disturbed by other processes
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return min(times)

    for n in rows:
        x = mx.random.normal((n, w_t.shape[0]))
        mx.eval(x)
        x_np = np.array(x)
        mx.eval(x @ w_t)
        x_np @ w_np  # warm-up
        t_mlx = fastest(lambda: mx.eval(x @ w_t))
        t_np = fastest(lambda: x_np @ w_np)
        lines.append(f"| {n} | {t_mlx * 1e3:.2f} | {t_np * 1e3:.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path(".bench/models/smollm2-f32"))
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-bits", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-mlx-lm", action="store_true")
    args = parser.parse_args()

    from mlxformer import load
    from mlxformer.cache import CacheSettings
    from mlxformer.engine import Engine

    model, tokenizer = load(args.model, threads=args.threads)
    prompts = [tokenizer.encode_prompt(p) for p in PROMPTS]
    settings = CacheSettings(kv_bits=args.kv_bits) if args.kv_bits else None
    lm = None
    if not args.no_mlx_lm:
        import mlx_lm

        lm = mlx_lm.load(str(args.model))
    results: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        results.setdefault(name, []).append(value)
        print(f"{name}: {value:.2f} tok/s", flush=True)

    engine = Engine(model, tokenizer, max_batch=max(args.clients), cache_settings=settings, prefix_cache_bytes=0)
    with engine:
        for _ in range(args.rounds):
            record("mlxformer generate, 1 stream", single_stream(model, tokenizer, prompts[0], args.tokens))
            if lm is not None:
                record("mlx-lm stream_generate, 1 stream", mlx_lm_single(*lm, prompts[0], args.tokens))
            for c in args.clients:
                aggregate, steady = engine_run(engine, prompts[:c], args.tokens, tokenizer.eos_token_ids)
                record(f"engine, {c} concurrent", aggregate)
                record(f"engine, {c} concurrent (steady decode)", steady)
                if lm is not None and c > 1:
                    record(f"mlx-lm batch_generate, {c} prompts", mlx_lm_batch(*lm, prompts[:c], args.tokens))
    scaling = matmul_scaling(model)
    base = statistics.median(results["mlxformer generate, 1 stream"])
    kv = f", kv_bits={args.kv_bits}" if args.kv_bits else ""
    print(f"\n{args.model.name}{kv}, {args.tokens} tokens per sequence, median of {args.rounds} rounds\n")
    print("| run | generated tok/s | vs mlxformer 1 stream |")
    print("|---|---:|---:|")
    for name, values in results.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.2f} | {median / base:.2f}x |")
    print("\nOne MLP projection (gate_proj), milliseconds, by token rows:\n")
    print("| rows | MLX matmul | numpy matmul |")
    print("|---:|---:|---:|")
    print("\n".join(scaling))


if __name__ == "__main__":
    main()
