"""A sequence's place in a ``KVPool`` row, for one layer (``cache/pool.py``): what the row's
caches of every kind (``RowCache``, ``rotating_rows.RingRowCache``, ``state_rows.StateRowCache``)
share, and ``RowCache``, one layer of a growing row."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import mlx.core as mx

from mlxformer.cache.batch import BatchLayerCache, Span, pad_pack, ring_spans
from mlxformer.cache.batch_kind import Held
from mlxformer.cache.codec import CENTER_BLOCK, FLOAT_CODEC, KVCodec, Pack
from mlxformer.cache.kv import CodecAttention
from mlxformer.models.mask import Mask, causal_mask_for

if TYPE_CHECKING:
    from mlxformer.cache.batch_kind import PoolKey, BatchRow, StorageKind


class RowHost(Protocol):
    """What a row's layer views ask of the pool the row lives in (``pool.KVPool``, which
    imports them)."""

    key: "PoolKey"

    @property
    def layers(self) -> Sequence[Any]:
        """Each layer's stacked rows."""
        ...

    @property
    def capacity(self) -> int:
        """Rows its buffers hold."""
        ...

    def __len__(self) -> int:
        """Rows in use."""
        ...

    def index(self, row: "BatchRow") -> int:
        """Where ``row`` is in the buffers now."""
        ...


class RowPlace:
    """Layer ``layer`` of ``row`` in ``pool``; what a forward being built wrote there counts in
    ``pending`` (``pendings``: the row's layers', shared by their caches) until the forward is built (``pool.record_writes``)."""

    segments = None  # the rows of one forward (``Cache.segments``)

    def __init__(self, pool: RowHost, row: "BatchRow", layer: int, pendings: dict[int, int]) -> None:
        self.pool, self.row, self.layer, self.pendings = pool, row, layer, pendings

    @property
    def index(self) -> int:
        """Where the row is in the pool's buffers now."""
        return self.pool.index(self.row)

    @property
    def pending(self) -> int:
        """Tokens written by the forward being built (< 0: trimmed back), not yet in the row."""
        return self.pendings[self.layer]

    @pending.setter
    def pending(self, tokens: int) -> None:
        self.pendings[self.layer] = tokens

    @property
    def offset(self) -> int:
        return self.row.offset + self.pending

    def make_mask(self, query_len: int, window: int | None) -> Mask:
        return causal_mask_for(query_len, self.offset + query_len, window)

    @property
    def meta_state(self) -> dict[str, str]:
        return self.row.metas[self.layer]

    @property
    def nbytes(self) -> int:
        """The row's share of its layer's buffers."""
        return self.pool.layers[self.layer].nbytes // max(1, len(self.pool))

    def recorded(self) -> None:
        """The forward's writes are recorded (``pool.record_writes``)."""
        self.pending = 0

    def _take_back(self, n: int) -> None:
        """Count ``n`` tokens trimmed: of the forward being built, then of the row, which moves
        back (``_move_back``) once every layer of it has been trimmed to the same length (a
        speculation round's rewind trims each layer by the same ``n``)."""
        self.pending -= n
        if self.pending < 0 and len(set(self.pendings.values())) == 1:
            self._move_back(self.offset)
            for layer in self.pendings:
                self.pendings[layer] = 0

    def _move_back(self, target: int) -> None:
        """The row back to its first ``target`` tokens in the layout its layer follows (a
        recurrent layer's: the first attention layout, maybe a ring's): a row whose slots hold
        its tokens in order (a growing row, a ring not yet turned) frees its later slots; a
        turned ring's index steps back over the slots it frees (``freed``: written first, and
        skipped when it is read in time order)."""
        layout, index, row = self.pool.layers[self.layer].layout, self.index, self.row
        kind = layout.kind
        layout.positions = layout.padded()
        if kind.capacity is None or row.used < kind.capacity:
            layout.positions[index, target:] = -1
            row.used = row.offset = row.idx = target
            return
        back, ring = row.offset - target, kind.capacity - kind.keep
        row.idx = kind.keep + (row.idx - kind.keep - back) % ring
        slots = mx.array([kind.keep + (row.idx - kind.keep + j) % ring for j in range(back)], dtype=mx.int32)
        layout.positions[index, slots] = -1
        row.offset, row.freed = target, row.freed + back


def seated(caches: Sequence[Any]) -> bool:
    """Whether ``caches`` are the views of a pool row (not a sequence's own caches)."""
    return bool(caches) and isinstance(caches[0], RowPlace)


class RowCache(RowPlace, CodecAttention):
    """One layer of one ``KVPool`` row behind the cache protocol: a sequence's own cache
    while its keys/values live in the pool (its prompt chunks, a rollback's trim, the views the
    prefix cache cuts blocks from). A chunk's write is counted in ``pending`` until the forward
    is built (``record_writes``: the row, shared by every layer, then moves once); a trim back
    into the row too, until every layer has trimmed to the same length (``pendings``: the row's
    layers', shared by their caches)."""

    def __init__(self, pool: RowHost, row: "BatchRow", layer: int, pendings: dict[int, int]) -> None:
        super().__init__(pool, row, layer, pendings)
        self.codec: KVCodec = FLOAT_CODEC  # the row's own (its key centers), for its attention

    @property
    def _layer(self) -> BatchLayerCache:
        layer = self.pool.layers[self.layer]
        assert isinstance(layer, BatchLayerCache)
        return layer

    def _row_codec(self, index: int, tokens: int) -> KVCodec:
        """The row's codec holding its own centers (those of the blocks its ``tokens`` reach)."""
        codec = self._layer.codec
        if codec.bits is None:
            return FLOAT_CODEC
        have = math.ceil(tokens / CENTER_BLOCK)
        center = codec.key_center[index : index + 1, :, :have] if codec.key_center is not None and have else None
        return codec.centered(center)

    def _slots(self, index: int, stop: int) -> tuple[Pack, Pack]:
        """Views of row ``index``'s first ``stop`` slots, in the buffers as written so far."""
        layer = self._layer
        return (tuple(x[index : index + 1, :, :stop] for x in layer.keys),
                tuple(x[index : index + 1, :, :stop] for x in layer.values))

    def _encode(self, index: int, keys: mx.array, values: mx.array) -> tuple[Pack, Pack]:
        """A chunk's keys/values at the next positions of row ``index`` encoded with the row's
        own key centers (``codec`` then holds the centers they reach)."""
        start = self.offset
        self.codec, new_keys, new_values = self._row_codec(index, start).store(keys, values, range(start, start + keys.shape[2]))
        return new_keys, new_values

    def write(self, index: int, start: int, keys: Pack, values: Pack, codec: KVCodec, stop: int) -> None:
        """Write packed ``keys``/``values`` (``stop - start`` slots, encoded with ``codec``) into
        the row's slots ``start:stop``, and the row's key centers into the batch's."""
        layer = self._layer
        layer.layout.fit(stop)
        width = layer.layout.width
        layer.keys, layer.values = pad_pack(layer.keys, width), pad_pack(layer.values, width)
        for target, source in zip(layer.keys + layer.values, keys + values):
            target[index : index + 1, :, start:stop, :] = source  # in place (its own row only)
        if codec.key_center is not None:
            mine = codec.key_center  # (1, n_kv, nb, D)
            center = layer.codec.key_center
            if center is None:
                center = mx.zeros((self.pool.capacity, *mine.shape[1:]), mine.dtype)
            n_blocks = max(center.shape[2], mine.shape[2])
            layer.codec = codec.centered(center).covering(n_blocks)
            assert layer.codec.key_center is not None
            layer.codec.key_center[index : index + 1] = codec.covering(n_blocks).key_center
        self.codec = codec

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Pack, Pack]:
        index, start, length = self.index, self.offset, keys.shape[2]
        new_keys, new_values = self._encode(index, keys, values)
        self.write(index, start, new_keys, new_values, self.codec, start + length)
        self.pending += length
        return self.fetch()

    def fetch(self) -> tuple[Pack, Pack]:
        """Views of the row's slots up to its written tokens, in the buffers as written so far."""
        return self._slots(self.index, self.offset)

    def _held(self, index: int, slots: list[int], positions: list[int], storage: "StorageKind") -> Held:
        """The row's ``slots`` (holding ``positions``, oldest first) as data: views when they
        are its first slots in order, else copies; the codec holding the row's key centers."""
        layer, codec = self._layer, self._row_codec(index, self.row.offset)
        if not slots:
            return Held(storage, self.meta_state, self.row.offset, codec=codec)
        if slots == list(range(len(slots))):
            keys, values = self._slots(index, len(slots))
        else:
            order = mx.array(slots, dtype=mx.int32)
            keys = tuple(mx.take(x[index : index + 1], order, axis=2) for x in layer.keys)
            values = tuple(mx.take(x[index : index + 1], order, axis=2) for x in layer.values)
        return Held(storage, self.meta_state, self.row.offset, keys, values, positions, codec)

    def held(self) -> Held:
        """The row's tokens as data (views of its slots: nothing is copied)."""
        used = self.row.used
        return self._held(self.index, list(range(used)), list(range(used)), self._layer.layout.kind)

    @property
    def state(self) -> tuple[mx.array, ...]:
        """Views of the row's slots (and its key centers)."""
        index, used = self.index, self.row.used
        keys, values = self._slots(index, used)
        return keys + values + self._row_codec(index, used).state

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens: of the forward being built, then of the row. The layers
        share the row's slots, so the row moves once every layer has been trimmed to the same
        length (``RowPlace._take_back``). A hybrid model's row gives nothing back unless its
        recurrent layers keep their last states (a speculating row: ``BatchRow.rewinds``)."""
        if not self.row.rewinds and any(storage.recurrent for storage, _ in self.pool.key):
            return 0
        n = min(n, self.offset)
        self._take_back(n)
        return n

    @property
    def _kind(self) -> "StorageKind":
        return self._layer.layout.kind

    def _pending(self) -> tuple[list[Span], int, int]:
        """``ring_spans`` of the row's pending tokens (written, not yet recorded)."""
        kind = self._kind
        return ring_spans(self.row.used, self.row.idx, kind.capacity, kind.keep, self.pending)

    def record(self) -> None:
        """Record the pending tokens in the row (``record_writes``): the slots they went to."""
        index, layout = self.index, self._layer.layout
        spans, used, idx = self._pending()
        layout.positions = layout.padded()
        for slot, token, n in spans:
            start = self.row.offset + token
            layout.positions[index, slot : slot + n] = mx.arange(start, start + n, dtype=mx.int32)
        self.row.used, self.row.idx, self.row.offset = used, idx, self.row.offset + self.pending
        self.row.freed = max(0, self.row.freed - self.pending)  # written first (``ring_spans`` starts at ``idx``)
