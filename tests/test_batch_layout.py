"""The batch layout's per-step host work does not grow with the context: a step's slots, offsets
and mask are MLX ops over a device array of positions, and the host handles a few numbers per
row (before: a (B, C) numpy array filled row by row, 78 ms at 32 rows of 32k tokens). The mask
it builds is checked against the rule written out in numpy."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest

from mlxformer.cache.batch import BatchLayout
from mlxformer.cache.batch_kind import BatchRow, StorageKind

FLOAT = StorageKind(rotating=False, capacity=None, max_size=None, keep=0, bits=None, group_size=64)


def layout_of(kind: StorageKind, window: int | None, lengths: list[int]) -> BatchLayout:
    """A layout whose rows hold ``lengths`` tokens in slot order (a growing cache's rows)."""
    layout = BatchLayout(kind, window)
    layout.fit(max(lengths) + 1)
    layout.rows = [BatchRow(n, n, n) for n in lengths]
    positions = np.full((len(lengths), layout.width), -1, dtype=np.int32)
    for i, n in enumerate(lengths):
        positions[i, :n] = np.arange(n)
    layout.positions = mx.array(positions)
    return layout


def host_seconds(layout: BatchLayout, steps: int = 30) -> float:
    """The fastest host time of ``prepare`` + ``commit`` over ``steps`` steps (the arrays they
    build are evaluated outside the timed part)."""
    best = float("inf")
    for _ in range(steps):
        begun = time.perf_counter()
        layout.prepare()
        layout.commit()
        best = min(best, time.perf_counter() - begun)
        mx.eval(layout.positions, layout.mask)
    return best


def test_step_host_time_does_not_grow_with_the_context():
    small = host_seconds(layout_of(FLOAT, None, [16]))
    large = host_seconds(layout_of(FLOAT, None, [32768 - 7 * i for i in range(32)]))
    assert large - small < 1e-3, (small, large)


@pytest.mark.parametrize("window", [None, 5])
def test_mask_and_slots_follow_the_positions(window):
    """Ragged rows: each row writes its next slot and sees the slots up to its own position
    (within ``window``), and the committed positions record the new token."""
    lengths = [3, 9, 1]
    layout = layout_of(FLOAT, window, lengths)
    layout.prepare()
    assert layout.slots.tolist() == lengths and layout.offsets.tolist() == lengths
    positions = np.full((3, layout.width), -1)
    for i, n in enumerate(lengths):
        positions[i, : n + 1] = np.arange(n + 1)
    query = np.array(lengths)[:, None]
    expected = (positions >= 0) & (positions <= query)
    if window is not None:
        expected &= positions > query - window
    assert np.array_equal(np.array(layout.mask[:, 0, 0]), expected)
    layout.commit()
    assert np.array_equal(np.array(layout.positions), positions)
    assert [(r.used, r.offset) for r in layout.rows] == [(n + 1, n + 1) for n in lengths]
