"""KV in one place (issue 32): a sequence's keys/values live in its row of a decode batch from
its first prompt chunk on, so joining the decode steps moves nothing.

A ``SpareBatch`` is a ``DecodeBatch`` of growing caches (float or quantized from the first token)
whose buffers ``(capacity, n_kv, C, ...)`` keep spare rows. A sequence takes a free row when it is
admitted (``seat``: an empty row, or a prefix-cache hit's tokens written into it); its prompt
chunks write there through ``RowCache`` (one layer of one row behind the cache protocol: ``L``
slots written in place, a causal mask, attention over the row's slots, exactly what its own
``KVCache`` computes); once its prompt is done it takes part in the batch's decode steps where it
is (the others' rows write a scratch slot and are not recorded: ``BatchLayout.prepare``). A
speculating sequence's rounds write their ``k + 1`` slots into its row the same way, and a
rejection trims them (``RowCache.trim``). Leaving frees the row (nothing copied out unless the caller keeps the caches). A full batch doubles its
capacity (bounded by ``max_rows``, the engine's ``max_batch``), so most admissions write into a
free row and rewrite nothing; the buffers are dropped when the last row leaves.

A hybrid model's recurrent layers keep their rows here too (``cache/state_rows.py``: the
attention layers' ``Row`` moves them). A row whose storage turns quantized at
``quantized_kv_start`` moves to a row of the quantized batch, re-encoded there
(``BatchRunner._cross``).

Under a KV budget (``staged``) the batch holds no spare row: a seat adds one row and a leave
removes it, so the buffers are the rows in use times the widest row, what the planner counts
(``engine/memory.py``); each such rewrite, and a widening (``reserve``), is done one layer at a
time, each evaluated before the next, so only one layer is ever held twice.

Rotating caches keep ``DecodeBatch``'s join-on-first-decode path (``batch_runner``).
"""

from __future__ import annotations

import math
from typing import Sequence

import mlx.core as mx

from mlxformer.cache.batch import BatchKey, BatchLayerCache, DecodeBatch, Row, _pad, _row_cache
from mlxformer.cache.codec import CENTER_BLOCK, FLOAT_CODEC, KVCodec, Pack, center_blocks, pack_nbytes, pack_slice
from mlxformer.cache.kv import CodecAttention, KVCache
from mlxformer.cache.protocol import Cache
from mlxformer.cache.state import StateCache
from mlxformer.cache.state_rows import StateRowCache, StateRows
from mlxformer.cache.rewrite import evaluate_rewrite
from mlxformer.models.mask import Mask, causal_mask_for

Blank = tuple[Pack, Pack]  # a layer's keys/values pack of one row and one slot (a recurrent layer's: its window, its state)


def seatable(caches: Sequence[Cache]) -> bool:
    """Whether a sequence's own caches can live in a ``SpareBatch`` row: growing caches (float,
    quantized, or turning quantized at ``quantized_kv_start``), maybe beside recurrent states."""
    return any(type(c) is KVCache for c in caches) and all(type(c) in (KVCache, StateCache) for c in caches)


def spare_kind(key: BatchKey) -> bool:
    """Whether a batch of ``key`` is a ``SpareBatch``: every attention layer a growing cache,
    stored alike (one slot layout for all), maybe beside recurrent layers."""
    attention = {kind for kind in key if not kind[0].recurrent}
    return len(attention) == 1 and not next(iter(attention))[0].rotating


def _rows_of(pack: Pack, rows: int, width: int) -> Pack:
    """Zero buffers like ``pack`` with ``rows`` rows of ``width`` slots."""
    return tuple(mx.zeros((rows, x.shape[1], width, x.shape[3]), x.dtype) for x in pack)


class SpareBatch(DecodeBatch):
    """A ``DecodeBatch`` whose rows are taken at admission and freed at leave (module doc)."""

    def __init__(self, key: BatchKey, blanks: Sequence[Blank], max_rows: int | None = None,
                 staged: bool = False) -> None:
        super().__init__(key)
        self.max_rows = max_rows
        self.staged = staged  # under a KV budget: no spare rows, every rewrite one layer at a time
        self.free: list[int] = []
        # growing caches stored alike: one slot layout for every attention layer, whose rows a
        # recurrent layer's rows follow (one ``Row`` per sequence for all layers)
        self.layouts = {kind: layout for kind, layout in self.layouts.items() if not kind[0].recurrent}
        (layout,) = self.layouts.values()
        self.layout = layout
        for (keys, values), (storage, _) in zip(blanks, key):
            if storage.recurrent:
                (conv,), (state,) = keys, values
                self.layers.append(StateRows(layout, mx.zeros((0, *conv.shape[1:]), conv.dtype),
                                             mx.zeros((0, *state.shape[1:]), state.dtype)))
                continue
            codec = FLOAT_CODEC if storage.bits is None else KVCodec(storage.bits, storage.group_size)
            self.layers.append(BatchLayerCache(layout, codec, _rows_of(keys, 0, 0), _rows_of(values, 0, 0)))

    def __len__(self) -> int:
        """Rows in use (a row's share of the buffers is theirs over this)."""
        return len(self.layout.rows) - len(self.free)

    @property
    def capacity(self) -> int:
        return len(self.layout.rows)

    @property
    def keeps_free_rows(self) -> bool:
        """Whether a leaving row stays in the buffers, free for the next seat (not under a budget)."""
        return not self.staged

    def _grow(self) -> None:
        """Double the rows (at least one more, at most ``max_rows`` unless more are needed; one
        more under a budget, ``staged``: the planner counts each row): the buffers are rewritten
        once, and the new rows are free."""
        old = self.capacity
        new = old + 1 if self.staged else max(old + 1, min(2 * old, self.max_rows or 2 * old))
        extra, width = new - old, self.layout.width
        for layer in self.layers:
            if isinstance(layer, StateRows):
                layer.add_rows(extra)
                continue
            layer.keys, layer.values = _pad(layer.keys, width), _pad(layer.values, width)
            layer.keys = tuple(mx.concatenate([x, *_rows_of((x,), extra, width)]) for x in layer.keys)
            layer.values = tuple(mx.concatenate([x, *_rows_of((x,), extra, width)]) for x in layer.values)
            center = layer.codec.key_center
            if center is not None:
                center = mx.concatenate([center, mx.zeros((extra, *center.shape[1:]), center.dtype)])
                layer.codec = KVCodec(layer.codec.bits, layer.codec.group_size, center)
            if self.staged:
                evaluate_rewrite(layer.state)
        empty = mx.full((extra, self.layout.positions.shape[1]), -1, dtype=mx.int32)
        self.layout.positions = mx.concatenate([self.layout.positions, empty])
        self.layout.rows += [Row(0, 0, 0) for _ in range(extra)]
        self.free += range(old, new)

    def seat(self, caches: list[Cache]) -> tuple[int, list["RowCache | StateRowCache"]]:
        """A free row for a sequence with own ``caches`` (growing, maybe holding a prefix-cache
        hit's tokens and states, written into the row: nothing else is copied); returns its
        index and its caches from now on. ``staged``: each layer written is evaluated and the own
        layer dropped (its entry becomes None), as ``DecodeBatch.join`` does."""
        if not self.free:
            self._grow()
        index = self.free.pop(0)
        used = int(caches[0].offset)
        row = Row(used, used, used, [c.meta_state for c in caches])
        self.layout.rows[index] = row
        if used:
            self.layout.fit(used)
            self.layout.positions = self.layout.padded()
            self.layout.positions[index, :used] = mx.arange(used, dtype=mx.int32)
        pendings = [0] * self.n_layers  # shared by the row's caches (``RowCache.pending``)
        views = [StateRowCache(self, row, layer, pendings) if isinstance(self.layers[layer], StateRows)
                 else RowCache(self, row, layer, pendings) for layer in range(self.n_layers)]
        for layer, view in enumerate(views):
            own = caches[layer]
            if isinstance(view, StateRowCache):
                assert isinstance(own, StateCache)
                view.reset(own)  # a freed row holds its last sequence's state
            elif used:
                assert isinstance(own, KVCache) and own.keys is not None and own.values is not None
                view.write(index, 0, pack_slice(own.keys, 0, used), pack_slice(own.values, 0, used), own.codec, used)
                if self.staged:
                    evaluate_rewrite(self.layers[layer].state)
                    caches[layer] = None  # type: ignore[call-overload]  # its keys/values now live in the row
        return index, views

    def reserve(self, slots: int) -> None:
        """Widen the rows to hold ``slots`` slots before a step writes past them (a prompt chunk,
        a speculation round): one layer at a time, each evaluated (``DecodeBatch.widen``), where
        the write would widen every layer in the forward's one graph."""
        self.layout.fit(slots)
        self.widen()

    def join(self, caches: Sequence[list[Cache]], staged: bool = False) -> list[list[Cache]]:  # type: ignore[override]
        """Rows from sequences with own caches (each copied into a free row)."""
        return [self.seat(c)[1] for c in caches]  # type: ignore[misc]

    def leave(self, index: int, keep: bool = True, staged: bool = False) -> list[Cache]:
        """Free row ``index``; returns its keys/values as own caches (copied) when ``keep``.
        ``staged`` batches remove it (the other rows move up, one layer at a time)."""
        if self.staged:
            return super().leave(index, keep, staged=True)
        row = self.layout.rows[index]
        caches: list[Cache] = []
        if keep:
            positions = mx.arange(row.used, dtype=mx.int32)
            caches = [_row_cache(layer, index, row, meta, positions, copy=True)
                      for layer, meta in zip(self.layers, row.metas)]  # type: ignore[arg-type]
        self.layout.rows[index] = Row(0, 0, 0)
        self.layout.positions[index] = -1
        self.free.append(index)
        self.free.sort()
        return caches

    def row_caches(self, index: int) -> list[Cache]:
        """Row ``index`` as per-sequence caches (keys/values: views of the buffers; states: copies)."""
        row = self.layout.rows[index]
        positions = self.layout.positions[index, : row.used]
        return [_row_cache(layer, index, row, meta, positions, copy=False)  # type: ignore[arg-type]
                for layer, meta in zip(self.layers, row.metas)]

    def index(self, row: Row) -> int:
        return next(i for i, r in enumerate(self.layout.rows) if r is row)


class RowCache(CodecAttention):
    """One layer of one ``SpareBatch`` row behind the cache protocol: a sequence's own cache
    while its keys/values live in the batch (its prompt chunks, a rollback's trim, the views the
    prefix cache cuts blocks from). A chunk's write is counted in ``pending`` until the runner
    ``settle``s the forward (the row, shared by every layer, then moves once); a trim back into
    the row too, until every layer has trimmed to the same length (``pendings``: every layer's,
    shared by the row's caches)."""

    def __init__(self, batch: SpareBatch, row: Row, layer: int, pendings: list[int]) -> None:
        self.batch, self.row, self.layer, self.pendings = batch, row, layer, pendings
        self.codec: KVCodec = FLOAT_CODEC  # the row's own (its key centers), for its attention

    @property
    def pending(self) -> int:
        """Tokens written by the forward being built (< 0: trimmed back), not yet in the row."""
        return self.pendings[self.layer]

    @pending.setter
    def pending(self, tokens: int) -> None:
        self.pendings[self.layer] = tokens

    @property
    def _layer(self) -> BatchLayerCache:
        layer = self.batch.layers[self.layer]
        assert isinstance(layer, BatchLayerCache)
        return layer

    @property
    def offset(self) -> int:
        return self.row.offset + self.pending

    def _row_codec(self, index: int, tokens: int) -> KVCodec:
        """The row's codec holding its own centers (those of the blocks its ``tokens`` reach)."""
        codec = self._layer.codec
        if codec.bits is None:
            return FLOAT_CODEC
        have = math.ceil(tokens / CENTER_BLOCK)
        center = codec.key_center[index : index + 1, :, :have] if codec.key_center is not None and have else None
        return KVCodec(codec.bits, codec.group_size, center)

    def write(self, index: int, start: int, keys: Pack, values: Pack, codec: KVCodec, stop: int) -> None:
        """Write packed ``keys``/``values`` (``stop - start`` slots, encoded with ``codec``) into
        the row's slots ``start:stop``, and the row's key centers into the batch's."""
        layer = self._layer
        self.batch.layout.fit(stop)
        width = self.batch.layout.width
        layer.keys, layer.values = _pad(layer.keys, width), _pad(layer.values, width)
        for target, source in zip(layer.keys + layer.values, keys + values):
            target[index : index + 1, :, start:stop, :] = source  # in place (its own row only)
        if codec.key_center is not None:
            mine = codec.key_center  # (1, n_kv, nb, D)
            center = layer.codec.key_center
            if center is None:
                center = mx.zeros((self.batch.capacity, *mine.shape[1:]), mine.dtype)
            n_blocks = max(center.shape[2], mine.shape[2])
            batch_codec = KVCodec(codec.bits, codec.group_size, center).covering(n_blocks)
            center = batch_codec.key_center
            assert center is not None
            center[index : index + 1] = codec.covering(n_blocks).key_center
            layer.codec = KVCodec(codec.bits, codec.group_size, center)
        self.codec = codec

    def make_mask(self, query_len: int, window: int | None) -> Mask:
        return causal_mask_for(query_len, self.offset + query_len, window)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Pack, Pack]:
        index, start, length = self.batch.index(self.row), self.offset, keys.shape[2]
        stop = start + length
        positions = range(start, stop)
        codec = self._row_codec(index, start).with_key_center(keys, positions)
        new_keys, new_values = codec.encode_keys(keys, center_blocks(positions)), codec.encode(values)
        self.write(index, start, new_keys, new_values, codec, stop)
        self.pending += length
        layer = self._layer
        return (tuple(x[index : index + 1, :, :stop] for x in layer.keys),
                tuple(x[index : index + 1, :, :stop] for x in layer.values))

    @property
    def state(self) -> tuple[mx.array, ...]:
        """Views of the row's slots (and its key centers)."""
        index, used = self.batch.index(self.row), self.row.used
        layer = self._layer
        views = tuple(x[index : index + 1, :, :used] for x in layer.keys + layer.values)
        return views + self._row_codec(index, used).state

    @property
    def meta_state(self) -> dict[str, str]:
        return self.row.metas[self.layer]

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens: of the forward being built, then of the row. The layers
        share the row's slots, so the row moves once every layer has been trimmed to the same
        length (a speculation round's rewind trims each layer by the same ``n``). A hybrid
        model's row gives nothing back: its recurrent states cannot go back (``state_rows``)."""
        if any(isinstance(layer, StateRows) for layer in self.batch.layers):
            return 0
        n = min(n, self.offset)
        self.pending -= n
        if self.pending < 0 and len(set(self.pendings)) == 1:
            target = self.offset
            index = self.batch.index(self.row)
            layout = self.batch.layout
            layout.positions = layout.padded()
            layout.positions[index, target:] = -1
            self.row.used = self.row.offset = self.row.idx = target
            self.pendings[:] = [0] * len(self.pendings)
        return n

    @property
    def nbytes(self) -> int:
        return (pack_nbytes(self._layer.keys) + pack_nbytes(self._layer.values)) // max(1, len(self.batch))


def settle(caches: Sequence[Cache]) -> None:
    """After a forward was built on a sequence's caches: record in its row what its
    ``RowCache``s (and ``StateRowCache``s) wrote (every layer wrote the same slots: the row moves once)."""
    rows = [c for c in caches if isinstance(c, (RowCache, StateRowCache))]
    if not rows or rows[0].pending <= 0:
        return
    first = rows[0]
    index, start, stop = first.batch.index(first.row), first.row.offset, first.offset
    layout = first.batch.layout
    layout.positions = layout.padded()
    layout.positions[index, start:stop] = mx.arange(start, stop, dtype=mx.int32)
    first.row.used = first.row.offset = first.row.idx = stop
    for cache in rows:
        cache.pending = 0
