"""Where a decode step's time goes: the weight matmuls alone versus the whole step.

Both runtimes call the same MLX matmul kernels, so the matmul share bounds how much any
runtime can gain on a model without changing the kernels or the dtype.

Usage: python benchmarks/decode_profile.py --model .bench/models/smollm2-bf16 [--context 256] [--steps 32] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import mlx.nn as nn

from mlxformer import load
from mlxformer.tools.bench import random_prompt
from mlxformer.cache import make_cache
from mlxformer.generation.stream import decode_step, prefill


def time_decode(model, context: int, steps: int) -> float:  # type: ignore[no-untyped-def]
    """Seconds per greedy decode step after a ``context``-token prefill."""
    cache = make_cache(model)
    token = mx.argmax(prefill(model, random_prompt(model.args.vocab_size, context), cache), axis=-1)
    mx.eval(token)
    start = time.perf_counter()
    for _ in range(steps):
        token = mx.argmax(decode_step(model, token, cache), axis=-1)
        mx.eval(token)
    return (time.perf_counter() - start) / steps


def time_matmuls(model, steps: int, rows: int = 1) -> float:  # type: ignore[no-untyped-def]
    """Seconds per step for only the projections (every Linear plus the vocabulary projection)
    at M = ``rows`` (a batched decode step's token rows)."""
    linears = [
        m for name, m in model.named_modules()
        # the layers themselves, not the private shard views of sharded ones
        if isinstance(m, (nn.Linear, nn.QuantizedLinear)) and not any(p.startswith("_") for p in name.split("."))
    ]
    dtype = model.model.norm.weight.dtype
    inputs = [mx.random.normal((rows, 1, m.weight.shape[1] * (32 // m.bits if isinstance(m, nn.QuantizedLinear) else 1))).astype(dtype) for m in linears]
    head_input = mx.random.normal((rows, 1, model.args.hidden_size)).astype(dtype)
    mx.eval(inputs, head_input)

    def one_step() -> None:
        outs = [m(x) for m, x in zip(linears, inputs)]
        outs.append(model.logits(head_input))
        mx.eval(outs)

    one_step()
    start = time.perf_counter()
    for _ in range(steps):
        one_step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="as mlxformer's --threads (default: the policy)")
    args = parser.parse_args()
    model, _ = load(args.model, threads=args.threads)
    step = time_decode(model, args.context, args.steps)
    matmuls = time_matmuls(model, args.steps)
    print(f"decode step {step * 1e3:.1f} ms | projections alone {matmuls * 1e3:.1f} ms | share {matmuls / step:.0%}")


if __name__ == "__main__":
    main()
