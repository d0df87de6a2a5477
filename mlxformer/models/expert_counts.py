"""When a forward's expert-sorted pairs are counted on the host, and the count.

On the CPU a row-sharded expert block (``row_sharding.ShardedSwitchGLU``) can project each
expert's contiguous rows with one matrix product instead of MLX's ``gather_mm``/``gather_qmm``
(a matrix-vector product per pair). That needs each expert's row count on the host: one sync,
which stalls the engine's overlap (``docs/design/scheduler.md``), so it is read once per block
and only where the products pay for it: never in a decode step, and elsewhere from
``COUNTED_PAIRS_PER_EXPERT`` pairs per expert (shapes known on the host).
"""

from __future__ import annotations

import itertools

import mlx.core as mx

# Mean (token, expert) pairs per expert from which the counted path beats the gather, float
# and quantized experts (``benchmarks/moe_counted.py``, docs/design/moe.md; 2 streams, loaded
# CPU): float crossed between 4 and 8 (Qwen3-MoE's and gpt-oss' shapes: 0.71-0.72x at 4,
# 0.96-1.25x at 8, 1.49x at 16); 4-bit did not gain up to 16 (0.78-1.05x), so from 32.
COUNTED_PAIRS_PER_EXPERT = {False: 8.0, True: 32.0}

ExpertBounds = tuple[tuple[int, int, int], ...]  # (expert, start, stop) of each expert with pairs


def counting_pays(pairs: int, experts: int, quantized: bool, decoding: bool) -> bool:
    """Whether ``pairs`` expert-sorted pairs over ``experts`` are worth a host read of the
    counts: never a decode step's (its one read is its tokens'), else from
    ``COUNTED_PAIRS_PER_EXPERT`` pairs per expert."""
    return not decoding and pairs >= COUNTED_PAIRS_PER_EXPERT[quantized] * experts


def expert_bounds(sorted_indices: mx.array, experts: int) -> ExpertBounds:
    """Each expert's ``[start, stop)`` in the pairs sorted by expert ``sorted_indices (P,)``,
    for the experts that have pairs: one host read."""
    counts = (sorted_indices[:, None] == mx.arange(experts)).sum(axis=0).tolist()  # (P, experts) -> (experts,)
    starts = itertools.accumulate(counts, initial=0)
    return tuple((expert, start, start + n) for expert, (start, n) in enumerate(zip(starts, counts)) if n)
