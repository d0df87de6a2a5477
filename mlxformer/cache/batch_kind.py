"""What sequences must share to be rows of one decode batch (``PoolKey``: each layer's storage
kind and attention window), a row's place in it (``BatchRow``), for ``cache/batch.py``, and
what one layer of a sequence holds, as data (``Held``: what a seat, a prefix-cache cut and a
row's move to the quantized pool exchange)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import mlx.core as mx

from mlxformer.cache.codec import FLOAT_CODEC, KVCodec, Pack, codec_settings, pack_slice, quantized_at


@dataclass(frozen=True)
class StorageKind:
    """What rows must share to live in one batch: the cache class, its bounds and storage."""

    rotating: bool
    capacity: int | None  # slots per row at most (None: unbounded)
    max_size: int | None  # tokens a query may see at most (the rotating window)
    keep: int  # sink tokens a rotating cache never evicts
    bits: int | None  # quantized storage bits now (None: float)
    group_size: int
    recurrent: bool = False  # a Gated DeltaNet layer's ``StateCache``: rows' states stacked, no slots


def takes_back(oldest: int, held: int, offset: int, n: int, max_size: int, keep: int) -> bool:
    """Whether a window of ``max_size`` tokens with ``keep`` sinks, holding ``held`` tokens
    (the oldest after its sinks at position ``oldest``) of ``offset``, can forget its last
    ``n``: it keeps a token beyond its sinks and every token the next query sees."""
    return held - n > keep and oldest <= max(keep, offset - n - (max_size - keep) + 1)


RECURRENT = StorageKind(False, None, None, 0, None, 0, recurrent=True)


@dataclass
class Held:
    """What one layer of a sequence's cache holds, as data: its storage (a per-sequence cache's:
    a rotating one's capacity without a row's extra slots), its settings (``meta_state``), the
    tokens it has seen, and its keys/values with the position each holds, oldest first (and the
    codec holding their key centers), or a recurrent layer's window and state (``()``: zeros).
    A cache gives it (``held()``); a pool's seat writes it into a row."""

    storage: StorageKind
    meta: dict[str, str]
    offset: int
    keys: Pack = ()
    values: Pack = ()
    positions: list[int] = field(default_factory=list)
    codec: KVCodec = FLOAT_CODEC
    state: tuple[mx.array, ...] = ()

    def quantized(self) -> "Held":
        """Its keys/values re-encoded into the quantized storage its settings name (a row
        crossing ``quantized_kv_start``); a recurrent layer's state stays as it is."""
        if self.storage.recurrent:
            return self
        codec = KVCodec(int(self.meta["bits"]), int(self.meta["group_size"]))
        keys = values = ()
        if self.keys:
            codec, keys, values = codec.store(self.codec.decode(self.keys), self.codec.decode(self.values), self.positions)
        return replace(self, storage=replace(self.storage, bits=codec.bits), meta={**self.meta, "quantized": "1"},
                       keys=keys, values=values, codec=codec)

    def back(self, n: int) -> "Held | None":
        """Without its last ``n`` tokens, when it can give them back (None: a recurrent state, or
        a window that has evicted a token the next query would see, ``takes_back``)."""
        size = len(self.positions)
        if self.storage.recurrent or n > size:
            return None
        storage = self.storage
        if size != self.offset and not takes_back(self.positions[storage.keep], size, self.offset, n,
                                                  storage.max_size or 0, storage.keep):
            return None
        return replace(self, offset=self.offset - n, keys=pack_slice(self.keys, 0, size - n),
                       values=pack_slice(self.values, 0, size - n), positions=self.positions[: size - n])

    @property
    def nbytes(self) -> int:
        """Bytes of its keys/values (or state), as a cache holding them counts them."""
        return sum(x.nbytes for x in (*self.keys, *self.values, *self.state))


def _kv_meta(row: "BatchRow") -> dict[str, str] | None:
    """An attention layer's settings in the row (not a recurrent one's), if it has one."""
    return next((m for m in row.metas if "bits" in m), None)


def row_quantized(row: "BatchRow") -> bool:
    """Whether a row stores its keys/values quantized."""
    meta = _kv_meta(row)
    return meta is not None and codec_settings(meta)[3]


def row_quantizes_next(row: "BatchRow", fed: int = 0) -> bool:
    """Whether a row's float storage turns quantized at its next token (``quantized_kv_start``;
    once ``fed`` more tokens are in: a prompt's later chunk in the same step)."""
    meta = _kv_meta(row)
    if meta is None:
        return False
    bits, _, start, quantized = codec_settings(meta)
    return not quantized and quantized_at(row.offset + fed + 1, bits, start)


@dataclass
class BatchRow:
    """One sequence's place in the batch (host-side; the same for every layer); the positions
    its slots hold are its row of the layout's device array."""

    used: int  # slots in use
    offset: int  # tokens seen (the next token's position)
    idx: int  # the next ring slot once every slot is used
    metas: list[dict[str, str]] = field(default_factory=list)  # each layer's cache settings, to rebuild it
    freed: int = 0  # a turned ring's slots from ``idx`` on holding no token (a trim freed them), written first
    rewinds: bool = False  # its recurrent layers keep their last tokens' states (a speculating row: ``state_rows``)


LayerKind = tuple[StorageKind, "int | None"]  # a layer's storage and attention window
PoolKey = tuple[LayerKind, ...]  # every layer's: the batch a sequence can join


def pool_key(held: Sequence[Held], windows: Sequence[int | None]) -> PoolKey:
    """The batch a sequence whose layers hold ``held`` (attending with ``windows``) can join."""
    return tuple((h.storage, w) for h, w in zip(held, windows))
