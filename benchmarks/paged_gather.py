"""What paged KV would cost a decode step without a paged-attention kernel (issue 40: the rest of
the line cut needs KV pages that rows, prefix blocks and disk entries point into).

MLX's ``mx.fast.scaled_dot_product_attention`` takes each row's keys and values as one contiguous
``(B, n_kv, T, D)`` array, and ``mx.fast`` has no paged attention (MLX 0.32). So a paged pool
would gather every row's pages into such an array for every layer at every step, then attend.
This measures one layer's decode attention both ways, trials interleaved in one process:

- ``contiguous``: the pool's rows as the engine keeps them now, attended in place;
- ``paged``: the same keys and values in pages of ``--page`` tokens, scattered over a page pool
  (a random block table per row), gathered with ``mx.take`` then attended.

It prints the time of each and their ratio per (rows, context), and the bytes each moves: the
contiguous step reads the KV once; the paged one reads the pages, writes the gathered copy and
reads it again (3x). On a GPU, where decode is bound by memory bandwidth (weights + KV read per
step), ``--weights-gib`` turns that into the step's expected slowdown, ``(W + 3K) / (W + K)``.
Only the CPU can be timed here; the Metal figure is that bound, not a measurement.

    python benchmarks/paged_gather.py --out benchmarks/results/paged_gather.md
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx


def _time(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` evaluated, over ``repeats`` calls (after one warm-up)."""
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def case(rows: int, context: int, heads: int, kv_heads: int, dims: int, page: int, dtype: mx.Dtype,
         trials: int, repeats: int) -> tuple[float, float, int]:
    """Median seconds of one layer's decode attention, contiguous and paged, and the KV bytes."""
    pages_per_row = context // page
    key = mx.random.key(0)
    k1, k2, k3, k4 = mx.random.split(key, 4)
    queries = mx.random.normal((rows, heads, 1, dims), key=k1).astype(dtype)
    keys = mx.random.normal((rows, kv_heads, context, dims), key=k2).astype(dtype)
    values = mx.random.normal((rows, kv_heads, context, dims), key=k3).astype(dtype)
    # the same tokens as pages (P, n_kv, page, D), row r's j-th page at table[r, j]
    order = mx.random.permutation(rows * pages_per_row, key=k4).astype(mx.int32)
    table = order.reshape(rows, pages_per_row)

    def paged_of(x: mx.array) -> mx.array:
        blocks = x.reshape(rows, kv_heads, pages_per_row, page, dims).transpose(0, 2, 1, 3, 4)
        blocks = blocks.reshape(rows * pages_per_row, kv_heads, page, dims)
        pool = mx.zeros_like(blocks)
        pool[order] = blocks
        return pool

    key_pages, value_pages = paged_of(keys), paged_of(values)
    mx.eval(queries, keys, values, key_pages, value_pages, table)
    scale = dims**-0.5

    def contiguous() -> mx.array:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale)

    def gather(pages: mx.array) -> mx.array:
        picked = mx.take(pages, table.reshape(-1), axis=0)  # (B * pages, n_kv, page, D)
        picked = picked.reshape(rows, pages_per_row, kv_heads, page, dims).transpose(0, 2, 1, 3, 4)
        return picked.reshape(rows, kv_heads, context, dims)

    def paged() -> mx.array:
        return mx.fast.scaled_dot_product_attention(queries, gather(key_pages), gather(value_pages), scale=scale)

    assert mx.allclose(contiguous(), paged(), atol=1e-3).item(), "the gathered pages are not the rows"
    firsts, seconds = [], []
    for trial in range(trials):  # interleaved, the order alternating
        pair = (contiguous, paged) if trial % 2 == 0 else (paged, contiguous)
        results = {f: _time(f, repeats) for f in pair}
        firsts.append(results[contiguous])
        seconds.append(results[paged])
    return statistics.median(firsts), statistics.median(seconds), keys.nbytes + values.nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--heads", type=int, default=32, help="query heads (Llama 3.1 8B's shapes by default)")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dims", type=int, default=128)
    parser.add_argument("--layers", type=int, default=32, help="for the per-step KV bytes")
    parser.add_argument("--weights-gib", type=float, default=4.5, help="weights read per step (8B at 4 bits)")
    parser.add_argument("--page", type=int, default=16, help="tokens per page (vLLM's default)")
    parser.add_argument("--dtype", choices=["float16", "float32"], default="float16")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, help="also write the table here (markdown)")
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype)
    weights = args.weights_gib * 2**30
    lines = [
        f"One layer's decode attention, {args.heads} query / {args.kv_heads} KV heads of {args.dims}, {args.dtype}, "
        f"pages of {args.page} tokens; MLX {mx.__version__} on {mx.default_device()}; "
        f"median of {args.trials} interleaved trials x {args.repeats} calls.",
        "",
        "| rows | context | contiguous ms | paged ms | paged / contiguous (measured) "
        f"| KV per step ({args.layers} layers) | bandwidth-bound step, weights {args.weights_gib} GiB: (W+3K)/(W+K) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rows in args.rows:
        for context in args.contexts:
            flat, paged, kv = case(rows, context, args.heads, args.kv_heads, args.dims, args.page, dtype,
                                   args.trials, args.repeats)
            step_kv = kv * args.layers
            bound = (weights + 3 * step_kv) / (weights + step_kv)
            lines.append(f"| {rows} | {context} | {flat * 1e3:.2f} | {paged * 1e3:.2f} | {paged / flat:.2f} "
                         f"| {step_kv / 2**30:.2f} GiB | {bound:.2f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
