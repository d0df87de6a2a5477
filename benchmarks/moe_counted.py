"""The host-counted expert path against the gather, per forward size (``models/expert_counts.py``'s threshold).

One routed-expert block (``SwitchGLU``) of a real model's shape, split over the CPU streams as
``load`` does (``row_sharding.ShardedSwitchGLU``), random routing (``k`` distinct experts per
token). For each token count, on the same input, A B B A interleaved, median wall time of:

- ``counted``: the pairs sorted by expert, their counts read on the host once, one matrix product
  per expert for gate, up and down (``SwitchRows.project_counted``);
- ``gather``: what a decode step runs: ``gather_mm``/``gather_qmm``, unsorted below
  ``moe.SORT_THRESHOLD`` pairs, sorted (row shards, one per stream) from it;
- ``gather1``: the sorted gather on one stream (the block unsplit, as on a GPU plan).

Shapes: ``gpt-oss`` (gpt-oss-20b: hidden 2880, 32 experts of 2880, top-4) and ``qwen3-moe``
(Qwen3-30B-A3B: hidden 2048, 128 experts of 768, top-8); ``--bits 0`` float32, ``4`` MLX's
affine 4-bit (group 64), ``mxfp4`` gpt-oss's.

  python benchmarks/moe_counted.py --shape gpt-oss --bits 4 --tokens 1 2 4 8 16 32 64 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))

from serving import load_average  # noqa: E402  (benchmarks/ is not a package)

SHAPES = {"gpt-oss": dict(hidden=2880, inter=2880, experts=32, k=4),
          "qwen3-moe": dict(hidden=2048, inter=768, experts=128, k=8)}


def make_blocks(shape: dict, bits: str, threads: int):
    """The same random experts as a ``ShardedSwitchGLU`` over ``threads`` streams and unsplit."""
    from mlxformer.models.moe import SwitchGLU
    from mlxformer.models.row_sharding import ShardedSwitchGLU, shard_block, shard_rows

    mx.random.seed(0)
    plain = SwitchGLU(shape["hidden"], shape["inter"], shape["experts"], "silu")
    if bits != "0":
        mode, group, width = ("mxfp4", 32, 4) if bits == "mxfp4" else ("affine", 64, int(bits))
        for name in ("gate_proj", "up_proj", "down_proj"):
            plain[name] = plain[name].to_quantized(group_size=group, bits=width, mode=mode)
    mx.eval(plain.parameters())
    split = shard_block(plain)  # a copy holding the same projections, then each split
    for name in ("gate_proj", "up_proj", "down_proj"):
        split[name] = shard_rows(plain[name], threads)
    assert isinstance(split, ShardedSwitchGLU)
    return split, plain


def median_ms(runs: dict[str, Callable[[], mx.array]], reps: int) -> dict[str, float]:
    """Each run's median wall time (one warm-up each, then A B B A rounds), in ms."""
    for run in runs.values():
        mx.eval(run())
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for rep in range(reps):
        for name in (order if rep % 2 == 0 else order[::-1]):
            start = time.perf_counter()
            mx.eval(runs[name]())
            times[name].append(time.perf_counter() - start)
    return {name: round(statistics.median(t) * 1000, 1) for name, t in times.items()}


def routing(tokens: int, experts: int, k: int, seed: int) -> mx.array:
    """``k`` distinct random experts per token: ``(tokens, k)``."""
    scores = mx.random.uniform(shape=(tokens, experts), key=mx.random.key(seed))
    return mx.argpartition(-scores, kth=k - 1, axis=-1)[:, :k]


def main() -> None:
    from mlxformer.models import expert_counts
    from mlxformer.models.moe import SORT_THRESHOLD

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="gpt-oss")
    parser.add_argument("--bits", choices=["0", "4", "8", "mxfp4"], default="0")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    shape = SHAPES[args.shape]
    split, plain = make_blocks(shape, args.bits, args.threads)
    E, k = shape["experts"], shape["k"]
    always, never = {False: 0.0, True: 0.0}, {False: float("inf"), True: float("inf")}

    def forced(threshold: dict[bool, float], block, x: mx.array, indices: mx.array) -> Callable[[], mx.array]:
        def run() -> mx.array:
            expert_counts.COUNTED_PAIRS_PER_EXPERT = threshold
            return block(x, indices)
        return run

    print(json.dumps({"shape": args.shape, **shape, "bits": args.bits, "threads": args.threads,
                      "load_before": load_average()}))
    for tokens in args.tokens:
        x = mx.random.normal((tokens, shape["hidden"]), key=mx.random.key(tokens))
        indices = routing(tokens, E, k, tokens)
        mx.eval(x, indices)
        runs = {"counted": forced(always, split, x, indices), "gather": forced(never, split, x, indices)}
        if tokens * k >= SORT_THRESHOLD:
            runs["gather1"] = forced(never, plain, x, indices)
        else:  # below the sort threshold the block never sorts, so never counts: nothing to compare
            runs = {"gather": runs["gather"]}
        ms = median_ms(runs, args.reps)
        row = {"tokens": tokens, "pairs": tokens * k, "pairs_per_expert": round(tokens * k / E, 2), **ms}
        if "counted" in ms:
            row["gather/counted"] = round(ms["gather"] / ms["counted"], 2)
        print(json.dumps(row), flush=True)
    print(json.dumps({"load_after": load_average()}))


if __name__ == "__main__":
    main()
