"""What sequences must share to be rows of one decode batch (``BatchKey``: each layer's storage
kind and attention window), and a row's place in it (``BatchRow``), for ``cache/batch.py``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from mlxformer.cache.kv import KVCache
from mlxformer.cache.protocol import Cache
from mlxformer.cache.rotating import RotatingKVCache
from mlxformer.cache.state import StateCache


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


def storage_kind(cache: Cache) -> StorageKind:
    """The batch a per-sequence cache can join."""
    if isinstance(cache, StateCache):
        return StorageKind(False, None, None, 0, None, 0, recurrent=True)
    if isinstance(cache, RotatingKVCache):
        return StorageKind(True, cache.capacity, cache.max_size, cache.keep, cache.codec.bits, cache.group_size)
    assert isinstance(cache, KVCache), f"cannot batch a {type(cache).__name__}"
    return StorageKind(False, None, None, 0, cache.codec.bits, cache.group_size)


def row_quantizes_next(row: "BatchRow", fed: int = 0) -> bool:
    """Whether a row's float storage turns quantized at its next token (``quantized_kv_start``;
    once ``fed`` more tokens are in: a prompt's later chunk in the same step)."""
    meta = next((m for m in row.metas if "bits" in m), None)  # an attention layer's (not a recurrent one's)
    if meta is None:
        return False
    return bool(meta["bits"]) and meta["quantized"] != "1" and row.offset + fed >= int(meta["start"])


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
BatchKey = tuple[LayerKind, ...]  # every layer's: the batch a sequence can join


def batch_key(caches: Sequence[Cache], windows: Sequence[int | None]) -> BatchKey:
    """The batch a sequence with per-layer ``caches`` (its layers attending with ``windows``) can join."""
    return tuple((storage_kind(c), w) for c, w in zip(caches, windows))
