"""Rotating rows: a rotating cache's window (a ``max_kv_size`` window, a sliding-window layer)
living in its row of a ``KVPool`` (``cache/pool.py``) from admission on.

A row of a rotating kind holds ``extra`` slots more than its cache's ``max_size + slack``
(``ring_key``: the batch key's capacity is the cache's plus ``extra``). Its slots fill, then
its ring over slots ``keep..capacity-1`` is written in turn, as a decode step writes it
(``BatchLayout.commit``). A prompt chunk writes its tokens in place at the ring's next slots
and attends over the row's slots, masked by the positions they hold (``RingRowCache``): a piece
of at most ``extra + 1`` tokens overwrites only the oldest ring tokens, at least
``max_size - keep + slack`` behind its first query, which no query of the piece sees; a
longer chunk is written and attended piece by piece. A row that does not take a decode step
writes the step's scratch at its next slot (``BatchLayout.prepare``): a free slot, or the
oldest ring slot, whose token is out of every later query's window and (``extra >= 1``) not
among the ``max_size + slack`` tokens the row gives back as a per-sequence cache would hold
them (``RingRowCache.held``). A rejected speculation round is taken back in the row, also once its ring
turned (``RingRowCache.takes_back``: the per-sequence cache's rule; ``RowPlace._move_back``: the
ring index steps back, the slots it passes are the row's ``freed`` ones, written first and read as
empty).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import mlx.core as mx

from mlxformer.cache.batch import Span, in_window, ring_spans
from mlxformer.cache.batch_kind import PoolKey, BatchRow, Held, StorageKind, takes_back
from mlxformer.cache.codec import CENTER_BLOCK, Pack, pack_slice
from mlxformer.cache.latent import Expand, latent_attention
from mlxformer.cache.row_place import RowCache
from mlxformer.models.mask import Mask


def ring_extra(max_size: int, chunk: int) -> int:
    """Slots a rotating row of window ``max_size`` keeps beyond its cache's: one prompt chunk
    of ``chunk`` tokens written at once (at most a window's, at least one: the scratch)."""
    return max(1, min(chunk, max_size) - 1)


def ring_key(key: PoolKey, chunk: int) -> PoolKey:
    """``key`` with each rotating layer's capacity grown by its ``ring_extra``."""
    return tuple((_grown(storage, chunk), window) if storage.rotating else (storage, window) for storage, window in key)


def _grown(storage: StorageKind, chunk: int) -> StorageKind:
    assert storage.capacity is not None and storage.max_size is not None
    return replace(storage, capacity=storage.capacity + ring_extra(storage.max_size, chunk))


def ring_slot(position: int, capacity: int, keep: int) -> int:
    """The slot a rotating row filled from the first token holds ``position`` in."""
    return position if position < keep else keep + (position - keep) % (capacity - keep)


def placement(
    storage: StorageKind, positions: list[int], offset: int, metas: list[dict[str, str]]
) -> tuple[BatchRow, list[Span]]:
    """The row of a sequence whose own cache holds ``positions`` (oldest first) of its
    ``offset`` tokens, and where they go: a growing row's from slot 0; a rotating row's each in
    the slot a row filled from the first token holds it in (``ring_slot``), so a prefix-cache
    hit's row is laid out as the row that computed it was (a chunk or a decode step then adds
    its terms in the same order: the same result bit for bit), its older slots empty."""
    if not storage.rotating or positions == list(range(offset)):
        return BatchRow(len(positions), offset, len(positions), metas), [(0, 0, len(positions))] if positions else []
    assert storage.capacity is not None
    capacity, keep = storage.capacity, storage.keep
    spans: list[Span] = []
    for token, position in enumerate(positions):
        slot = ring_slot(position, capacity, keep)
        if spans and spans[-1][0] + spans[-1][2] == slot:
            spans[-1] = (spans[-1][0], spans[-1][1], spans[-1][2] + 1)
        else:
            spans.append((slot, token, 1))
    empty = capacity - keep - sum(p >= keep for p in positions)  # the ring slots from the next one on
    return BatchRow(capacity, offset, ring_slot(offset, capacity, keep), metas, freed=empty), spans


def time_slots(row: BatchRow, capacity: int, keep: int) -> list[int]:
    """The row's slots holding a token, oldest first (a turned ring's ``freed`` slots skipped)."""
    if row.used < capacity or (row.idx == keep and not row.freed):
        return list(range(row.used))
    ring = [*range(row.idx, capacity), *range(keep, row.idx)]
    return [*range(keep), *ring[row.freed :]]


Piece = tuple[Pack, Pack, mx.array, mx.array]  # a piece's row keys, values, mask (count, C) and key blocks (C,)
Attend = Callable[[tuple[mx.array, ...], Pack, Pack, mx.array, mx.array], mx.array]


class RingRowCache(RowCache):
    """One layer of a rotating row: what it does differently from a growing row's ``RowCache``
    is that a chunk is written at the ring's next slots and attended piece by piece (module doc)."""

    fetch = None  # type: ignore[assignment]  # a chunk is written where it attends, piece by piece: nothing to fetch before
    _written: tuple[Pack, list[tuple[int, int, Piece]]] | None = None  # the chunk written, its pieces

    def _positions(self, index: int) -> mx.array:
        """The positions ``(C,)`` the row's slots hold with its pending tokens written."""
        positions = self._layer.layout.padded()[index]
        for slot, token, n in self._pending()[0]:
            start = self.row.offset + token
            positions[slot : slot + n] = mx.arange(start, start + n, dtype=mx.int32)
        return positions

    def make_mask(self, query_len: int, window: int | None) -> Mask:
        return None  # each piece's mask is built where it attends (``_pieces``)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Pack, Pack]:
        """The chunk encoded (its key centers set); written when it attends."""
        return self._encode(self.index, keys, values)

    def attention(
        self, queries: mx.array, keys: Pack, values: Pack, scale: float, mask: Mask, softcap: float | None = None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        return self._pieces((queries,), keys, values,
                            lambda q, k, v, m, b: self.codec.attention(q[0], k, v, scale, m, softcap, b, sinks))

    def latent_attention(
        self, q_latent: mx.array, q_rope: mx.array, keys: Pack, values: Pack, scale: float, mask: Mask
    ) -> mx.array:
        return self._pieces((q_latent, q_rope), keys, values,
                            lambda q, k, v, m, b: latent_attention(self.codec, q[0], q[1], k, v, scale, m, b))

    def expanded_attention(
        self, q_nope: mx.array, q_rope: mx.array, keys: Pack, values: Pack, mask: Mask, expand: Expand
    ) -> mx.array:
        """MLA's expanded form, piece by piece: each piece's keys and values expanded from the
        row's latents (float), masked by the positions its slots hold."""
        return self._pieces((q_nope, q_rope), keys, values, lambda q, k, v, m, b: expand(q[0], q[1], k[0], v[0], m))

    def _pieces(self, queries: tuple[mx.array, ...], keys: Pack, values: Pack, attend: Attend) -> mx.array:
        """Attend the chunk's ``queries`` (each ``(1, heads, L, D)``) piece by piece over the row,
        the chunk ``keys``/``values`` written first (once: a layer reading this one's keys and
        values, Gemma 4's KV-shared layers, attends over the same pieces)."""
        if self._written is None or self._written[0] is not keys:
            self._written = (keys, self._write(keys, values))
        outs = [attend(tuple(q[:, :, first : first + count] for q in queries), *piece)
                for first, count, piece in self._written[1]]
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)

    def _write(self, keys: Pack, values: Pack) -> list[tuple[int, int, Piece]]:
        """Write the chunk into the row in pieces of at most ``extra + 1`` tokens; each piece's
        first token, length and what its queries attend over."""
        index, length, kind = self.index, keys[0].shape[2], self._kind
        assert kind.capacity is not None and kind.max_size is not None
        size = kind.capacity - kind.max_size - int(self.row.metas[self.layer].get("slack", "0")) + 1
        pieces = []
        for first in range(0, length, size):
            count = min(size, length - first)
            start = self.offset
            _, used, idx = self._pending()
            for slot, token, n in ring_spans(used, idx, kind.capacity, kind.keep, count)[0]:
                a = first + token
                self.write(index, slot, pack_slice(keys, a, a + n), pack_slice(values, a, a + n), self.codec, slot + n)
            self.pending += count
            width = self._pending()[1]  # the row's slots (not the pool's width: its own terms alone)
            positions = self._positions(index)[:width]  # (C,)
            query = mx.arange(start, start + count)[:, None]  # (count, 1)
            visible = (positions >= 0) & (positions <= query)
            visible = in_window(visible, positions, query, kind, self._layer.layout.window)
            row_keys, row_values = self._slots(index, width)
            pieces.append((first, count, (row_keys, row_values, visible, mx.maximum(positions, 0) // CENTER_BLOCK)))
        return pieces

    def recorded(self) -> None:
        """The forward's writes are recorded (``record_writes``): its pieces' views go (they would keep
        the buffers they view from being written in place)."""
        super().recorded()
        self._written = None

    def held(self) -> Held:
        """The row's window as data, as a per-sequence cache of it holds it: its sinks and newest
        tokens in time order, at most ``max_size + slack`` (copies)."""
        kind, row, meta = self._kind, self.row, self.meta_state
        assert kind.capacity is not None
        capacity = int(meta["max_size"]) + int(meta.get("slack", "0"))
        slots = time_slots(row, kind.capacity, kind.keep)
        if len(slots) > capacity:
            slots = slots[: kind.keep] + slots[len(slots) - (capacity - kind.keep) :]
        index = self.index
        positions = mx.take(self._layer.layout.padded()[index], mx.array(slots, dtype=mx.int32)).tolist() if slots else []
        return self._held(index, slots, positions, replace(kind, capacity=capacity))

    def takes_back(self, n: int) -> bool:
        """Whether the last ``n`` tokens can be taken back: while the slots hold every token in
        order (the pending ones too); once the ring turned, when what the forward wrote is
        recorded (else it overwrote ring tokens the row still counts), by the per-sequence
        cache's rule (``rotating.takes_back``: its ``slack`` covers a round's rejected tokens)."""
        kind, row = self._kind, self.row
        assert kind.capacity is not None and kind.max_size is not None
        if row.used < kind.capacity:
            return row.used == row.offset and row.used + self.pending <= kind.capacity
        if self.pending > 0:
            return False
        ring = kind.capacity - kind.keep - row.freed  # the ring's tokens: the newest, in order
        return takes_back(row.offset - ring, kind.keep + ring, row.offset, n - self.pending, kind.max_size, kind.keep)

    def trim(self, n: int) -> int:
        """As a growing row's, where the ring can take the tokens back (``takes_back``; else 0)."""
        n = min(n, self.offset)
        return super().trim(n) if self.takes_back(n) else 0
