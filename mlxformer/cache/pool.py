"""KV in one place (issues 32, 40): a sequence's keys/values live in its row of a pool from
admission on, so its prompt chunks, speculation rounds and decode steps all write there.

A ``KVPool`` is the pool of one storage kind (``PoolKey``): every layer's buffers
``(capacity, n_kv, C, ...)`` (growing or rotating, float or quantized) with spare rows, and the
slot layouts of its rows (``cache/batch.py``). A sequence takes a free row when it is
admitted (``seat``: an empty row, or a prefix-cache hit's tokens written into it, each layer's
given as data, ``batch_kind.Held``); its prompt
chunks write there through ``RowCache`` (one layer of one row behind the cache protocol: ``L``
slots written in place, a causal mask, attention over the row's slots, exactly what its own
``KVCache`` computes); once its prompt is done it takes part in the batch's decode steps where it
is (the others' rows write a scratch slot and are not recorded: ``BatchLayout.prepare``). A
speculating sequence's rounds write their ``k + 1`` slots into its row the same way, and a
rejection trims them (``RowCache.trim``). Leaving frees the row (nothing is copied out). A full batch doubles its
capacity (bounded by ``max_rows``, the engine's ``max_batch``), so most admissions write into a
free row and rewrite nothing; the buffers are dropped when the last row leaves.

A hybrid model's recurrent layers keep their rows here too (``cache/state_rows.py``: the
attention layers' ``BatchRow`` moves them). A row whose storage turns quantized at
``quantized_kv_start`` moves to a row of the quantized batch, re-encoded there
(``BatchRunner._cross``).

Under a KV budget (``staged``) the batch holds no spare row: a seat adds one row and a leave
removes it (every layout's row, a recurrent layer's states too), so the buffers are the rows in
use times the widest row, what the planner counts (``engine/memory.py``: a ring row's slots
beyond its window, a recurrent row's state); each such rewrite, and a widening (``reserve``,
every layout), is done one layer at a time, each evaluated before the next, so only one layer
is ever held twice. A seat that copies tokens in (what a prefix-cache hit's blocks hold,
``Held`` per layer; a crossing row's re-encoded window) grows, writes and evaluates each layer in turn
and drops that layer's source before the next, so the tokens are held twice one layer at a time.

A rotating cache (a ``max_kv_size`` window, a sliding-window layer) lives in a row of a ring
(``cache/rotating_rows.py``); a model mixing sliding-window and global layers keeps one slot
layout per kind of layer, each with the sequence's row at the same index. Beside recurrent
layers (a hybrid model with a ``max_kv_size`` window) the recurrent rows follow the ring's
layout (a rejected speculation round moves them back with it: ``RowPlace._move_back``).
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from mlxformer.cache.batch import BatchLayerCache, BatchLayout, pad_pack
from mlxformer.cache.batch_kind import PoolKey, BatchRow, Held, LayerKind
from mlxformer.cache.codec import KVCodec, Pack, pack_slice
from mlxformer.cache.protocol import Cache
from mlxformer.cache.row_place import RowCache
from mlxformer.cache.rotating_rows import RingRowCache, placement
from mlxformer.cache.state_rows import StateRowCache, StateRows, state_blank
from mlxformer.cache.rewrite import evaluate_rewrite
from mlxformer.errors import MlxformerError

Blank = tuple[Pack, Pack]  # a layer's keys/values pack of one row and one slot (a recurrent layer's: its window, its state)


def _no_rows(pack: Pack) -> Pack:
    """Buffers like ``pack`` with no rows and no slots."""
    return tuple(mx.zeros((0, x.shape[1], 0, x.shape[3]), x.dtype) for x in pack)


def blanks(args: Any, dtype: mx.Dtype, kind: PoolKey) -> list[Blank]:
    """Each cache layer of a model of ``args`` (its ``ModelArgs``; keys in ``dtype``) as one
    slot of ``kind`` stores it: the shapes a ``KVPool`` allocates (lazy, never evaluated)."""
    out = []
    for index, (storage, _) in enumerate(kind):
        if storage.recurrent:
            out.append(state_blank(args, dtype))
            continue
        heads, key_dims, value_dims = args.cache_dims(index)
        codec = KVCodec(storage.bits, storage.group_size)
        out.append((codec.encode(mx.zeros((1, heads, 1, key_dims), dtype)),
                    codec.encode(mx.zeros((1, heads, 1, value_dims), dtype))))
    return out


class KVPool:
    """Every layer's keys/values (or recurrent states) of the sequences of one ``PoolKey``, one
    row each, from admission to retirement (module doc): a slot layout per kind of attention
    layer and one ``BatchLayerCache`` (or ``StateRows``) per layer."""

    def __init__(self, key: PoolKey, blanks: Sequence[Blank], max_rows: int | None = None,
                 staged: bool = False) -> None:
        self.key = key
        self.groups: dict[LayerKind, list[int]] = {}  # each kind's layers, in order
        for layer, kind in enumerate(key):
            self.groups.setdefault(kind, []).append(layer)
        self.max_rows = max_rows
        self.staged = staged  # under a KV budget: no spare rows, every rewrite one layer at a time
        self.free: list[int] = []
        # one slot layout per kind of attention layer, each with a sequence's row at the same
        # index; a recurrent layer's rows follow the first attention layout
        self.layouts = {kind: BatchLayout(*kind) for kind in self.groups if not kind[0].recurrent}
        if not self.layouts:
            raise MlxformerError("the engine needs a model with at least one attention layer")
        self.layout = next(iter(self.layouts.values()))  # the first kind's (the recurrent rows')
        self.layers: list[BatchLayerCache | StateRows] = []
        for (keys, values), kind in zip(blanks, key):
            storage = kind[0]
            if storage.recurrent:
                (conv,), (state,) = keys, values
                self.layers.append(StateRows(self.layout, mx.zeros((0, *conv.shape[1:]), conv.dtype),
                                             mx.zeros((0, *state.shape[1:]), state.dtype)))
                continue
            codec = KVCodec(storage.bits, storage.group_size)
            self.layers.append(BatchLayerCache(self.layouts[kind], codec, _no_rows(keys), _no_rows(values)))

    def __len__(self) -> int:
        """Rows in use (a row's share of the buffers is theirs over this)."""
        return self.capacity - len(self.free)

    @property
    def capacity(self) -> int:
        return len(self.layout.rows)  # every kind's layout has a row per sequence

    def _add_rows(self) -> int:
        """Double the rows (at least one more, at most ``max_rows`` unless more are needed; one
        more under a budget, ``staged``: the planner counts each row) in every layout, the new
        rows free; returns how many were added. The layers' buffers take them at ``_grow_layer``."""
        old = self.capacity
        new = old + 1 if self.staged else max(old + 1, min(2 * old, self.max_rows or 2 * old))
        extra = new - old
        for layout in self.layouts.values():
            empty = mx.full((extra, layout.positions.shape[1]), -1, dtype=mx.int32)
            layout.positions = mx.concatenate([layout.positions, empty])
            layout.rows += [BatchRow(0, 0, 0) for _ in range(extra)]
        self.free += range(old, new)
        return extra

    def _grow_layer(self, index: int, extra: int) -> None:
        """Layer ``index``'s buffers with ``extra`` zero rows at the end, as wide as its layout
        (lazy, ``pad_pack``)."""
        layer = self.layers[index]
        if isinstance(layer, StateRows):
            layer.add_rows(extra)
            return
        width = layer.layout.width
        layer.keys, layer.values = pad_pack(layer.keys, width, extra), pad_pack(layer.values, width, extra)
        center = layer.codec.key_center
        if center is not None:
            center = mx.pad(center, [(0, extra)] + [(0, 0)] * (center.ndim - 1))
            layer.codec = layer.codec.centered(center)

    def seat(self, held: list[Held | None]) -> tuple[int, list["RowCache | StateRowCache"]]:
        """A free row for a sequence whose layers hold ``held`` (maybe a prefix-cache hit's tokens
        and states, written into the row: ``placement``; nothing else is copied); returns its
        index and its caches from now on. A full batch adds rows (``_add_rows``) to each layer
        just before that layer's row is written. ``staged``: one layer at a time, each evaluated
        before the next and its entry of ``held`` dropped then (None), so the tokens copied in
        are held twice one layer at a time, not whole (``_write_layer``)."""
        extra = 0 if self.free else self._add_rows()
        index = self.free.pop(0)
        metas = [h.meta for h in held]  # type: ignore[union-attr]
        rows, spans, pendings = {}, {}, {}
        for kind, layers in self.groups.items():
            if kind[0].recurrent:
                continue
            layout, positions = self.layouts[kind], held[layers[0]].positions  # type: ignore[union-attr]
            rows[kind], spans[kind] = placement(kind[0], positions, held[layers[0]].offset, metas)  # type: ignore[union-attr]
            pendings[kind] = {layer: 0 for layer in layers}  # shared by the row's caches (``RowCache.pending``)
            layout.rows[index] = rows[kind]
            if positions:
                layout.fit(rows[kind].used)
                layout.positions = layout.padded()
                for slot, token, n in spans[kind]:
                    layout.positions[index, slot : slot + n] = mx.array(positions[token : token + n], dtype=mx.int32)
        first = next(iter(self.layouts))  # the kind whose row a recurrent layer's follows
        views: list[RowCache | StateRowCache] = []
        for layer, kind in enumerate(self.key):
            if kind[0].recurrent:
                pendings[first][layer] = 0
                views.append(StateRowCache(self, rows[first], layer, pendings[first]))
            else:
                views.append((RingRowCache if kind[0].rotating else RowCache)(self, rows[kind], layer, pendings[kind]))
        for layer, kind in enumerate(self.key):
            if extra:
                self._grow_layer(layer, extra)
            self._write_layer(index, views[layer], held[layer], spans.get(kind, []))  # type: ignore[arg-type]
            if self.staged:
                held[layer] = None  # now in the row
                evaluate_rewrite(self.layers[layer].state)
        return index, views

    @staticmethod
    def _write_layer(index: int, view: "RowCache | StateRowCache", held: Held, spans: list[tuple[int, int, int]]) -> None:
        """Write one layer of row ``index`` from ``held``: its tokens at ``spans`` (slot, token,
        count), or its recurrent state (a hit's snapshot, or zeros: a freed row holds its last
        sequence's). Nothing of ``held`` is referenced after."""
        if isinstance(view, StateRowCache):
            view.reset(held.state)
            return
        for slot, token, n in spans:
            view.write(index, slot, pack_slice(held.keys, token, token + n), pack_slice(held.values, token, token + n),
                       held.codec, slot + n)

    def reserve(self, slots: int) -> None:
        """Widen the rows to hold ``slots`` slots before a step writes past them (a prompt chunk,
        a speculation round): one layer at a time, each evaluated (``widen``), where
        the write would widen every layer in the forward's one graph. Every kind's layout (a
        rotating one's never past its row's capacity)."""
        for layout in self.layouts.values():
            layout.fit(slots)
        self.widen()

    def leave(self, index: int) -> None:
        """Free row ``index`` (nothing is copied out). A ``staged`` pool (under a budget) removes
        it: the rows below move up, each layout narrows to what the others need, and each layer
        (keys/values, or a recurrent layer's states) is rewritten and evaluated before the next."""
        if self.staged:
            rest = mx.array([i for i in range(self.capacity) if i != index], dtype=mx.int32)
            for layout in self.layouts.values():
                layout.remove(index, rest)
            for batched in self.layers:
                batched.keep_rows(rest)
                evaluate_rewrite(batched.state)
            return
        for layout in self.layouts.values():
            layout.rows[index] = BatchRow(0, 0, 0)
            layout.positions[index] = -1
        self.free.append(index)
        self.free.sort()

    def index(self, row: BatchRow) -> int:
        return next(i for layout in self.layouts.values() for i, r in enumerate(layout.rows) if r is row)

    def step_caches(self, stepping: Sequence[int] | None = None) -> list[BatchLayerCache | StateRows]:
        """The per-layer caches for this step's forward (the layouts prepared; ``stepping``: the
        rows taking a token, default all). ``staged``: buffers that must widen for the step are
        widened one layer at a time (evaluated)."""
        for layout in self.layouts.values():
            layout.prepare(stepping)
        if self.staged:
            self.widen()
        return self.layers

    def widen(self) -> None:
        """Pad each layer's buffers to its layout's width one layer at a time, each evaluated
        before the next (under a KV budget: only one layer is held twice)."""
        for cache in self.layers:
            if isinstance(cache, BatchLayerCache) and cache.keys[0].shape[2] < cache.layout.width:
                cache.keys, cache.values = pad_pack(cache.keys, cache.layout.width), pad_pack(cache.values, cache.layout.width)
                evaluate_rewrite(cache.keys, cache.values)


def record_writes(caches: Sequence[Cache]) -> None:
    """Record in the pools what a forward just built over ``caches`` wrote (the decoder calls
    this at the end of every forward, ``Model.run_layers``): a decode step's token in each of
    its pools' layouts (``BatchLayout.commit``), then the tokens a row's ``RowCache``s and
    ``StateRowCache``s wrote (the layers of one kind wrote the same slots: each row moves once).
    A packed step's parts are its segments' caches. Own caches record as they write."""
    parts = [p for c in caches for p in ([s.cache for s in c.segments] if c.segments else [c])]
    for layout in {id(p.layout): p.layout for p in parts if isinstance(p, BatchLayerCache)}.values():
        layout.commit()
    rows = [p for p in parts if isinstance(p, (RowCache, StateRowCache)) and p.pending > 0]
    moved: set[int] = set()
    for cache in rows:
        if isinstance(cache, RowCache) and id(cache.row) not in moved:
            moved.add(id(cache.row))
            cache.record()
    for cache in rows:
        cache.recorded()
