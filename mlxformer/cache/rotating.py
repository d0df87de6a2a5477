"""The rotating KV cache: a bounded window that keeps the first ``keep`` tokens (attention sinks).

Semantics: the query at position ``p`` sees the ``keep`` sink tokens and the last
``max_size - keep`` tokens up to ``p`` — exactly what token-by-token decoding through a
ring buffer of ``max_size`` slots would see, also for multi-token chunks larger than the window.
"""

from __future__ import annotations

import mlx.core as mx

from mlxformer.models.mask import Mask, causal_mask_for
from mlxformer.cache.batch import in_window
from mlxformer.cache.batch_kind import StorageKind, takes_back
from mlxformer.cache.codec import CENTER_BLOCK, Pack, codec_settings, pack_concat, pack_slice, pack_write
from mlxformer.cache.kv import OwnCache
from mlxformer.errors import MlxformerError


def time_spans(size: int, capacity: int, keep: int, idx: int) -> list[tuple[int, int]]:
    """The spans of a ring's ``size`` used slots (of ``capacity``, the next to write ``idx``)
    in token order, oldest first: the sinks, then the rotated tail."""
    return [(0, size)] if size < capacity or idx == keep else [(0, keep), (idx, size), (keep, idx)]


class RotatingKVCache(OwnCache):
    """At most ``max_size`` tokens of keys/values, float or (with ``bits``) quantized.

    ``slack`` extra slots keep that many tokens beyond the window (masked out), so that the
    last ``slack`` tokens can be trimmed even after evictions (speculative decoding rewinds).

    Single-token updates write in place into a ring over slots ``keep..capacity-1``;
    multi-token updates return the stored window plus the chunk in time order (attended with
    an explicit mask) and then keep the sinks and the newest tokens. ``offset`` counts every
    token seen, so RoPE positions keep growing past the window.
    """

    def __init__(
        self, max_size: int = 4096, keep: int = 4, bits: int | None = None, group_size: int = 64, start: int = 0,
        slack: int = 0,
    ) -> None:
        self._configure(max_size, keep, bits, group_size, start, quantized=bits is not None and start <= 0, slack=slack)

    def _configure(
        self, max_size: int, keep: int, bits: int | None, group_size: int, start: int, quantized: bool, slack: int = 0
    ) -> None:
        if not 0 <= keep < max_size:
            raise MlxformerError(f"the rotating cache needs 0 <= keep < max_kv_size, got keep={keep}, max_kv_size={max_size}")
        self._configure_storage(bits, group_size, start, quantized)  # keys/values: (B, n_kv, capacity, ...) slots
        self.max_size, self.keep = max_size, keep
        self.slack = max(0, slack)
        self.capacity = max_size + self.slack  # slots stored; the mask shows at most max_size
        self.positions: list[int] = []  # absolute token position held by each used slot
        self._fetched: list[int] = []  # the position of each key the last update_and_fetch returned
        self.idx = 0  # next slot to write once the ring is full

    @property
    def size(self) -> int:
        """Slots in use."""
        return len(self.positions)

    # --- storage -----------------------------------------------------------------------

    @property
    def storage(self) -> StorageKind:
        return StorageKind(True, self.capacity, self.max_size, self.keep, self.codec.bits, self.group_size)

    def time_order(self) -> tuple[Pack, Pack, list[int]]:
        """The stored keys, values and their positions, oldest first."""
        assert self.keys is not None and self.values is not None
        spans = time_spans(self.size, self.capacity, self.keep, self.idx)
        if len(spans) == 1:
            return pack_slice(self.keys, 0, self.size), pack_slice(self.values, 0, self.size), list(self.positions)
        keys = pack_concat([pack_slice(self.keys, a, b) for a, b in spans])
        values = pack_concat([pack_slice(self.values, a, b) for a, b in spans])
        return keys, values, self._time_positions()

    def _held(self) -> list[int]:
        return self.positions

    def _write_one(self, keys: Pack, values: Pack) -> None:
        """Write one token in place: in the next free slot while there is one, else over the
        oldest token after the sinks (slot ``idx``)."""
        assert self.keys is not None and self.values is not None
        slot = self.size if self.size < self.capacity else self.idx
        if slot == self.keys[0].shape[2]:  # grow by a step, never past self.capacity
            self._grow(slot, min(self.step, self.capacity - slot))
        pack_write(self.keys, slot, keys)
        pack_write(self.values, slot, values)
        if slot == self.size:
            self.positions.append(self.offset)
        else:
            self.positions[slot] = self.offset
        self.idx = slot + 1 if slot + 1 < self.capacity else self.keep

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Pack, Pack]:
        length = keys.shape[2]
        new_keys, new_values = self._store(keys, values, range(self.offset, self.offset + length))
        if length == 1:
            self._write_one(new_keys, new_values)
            self.offset += 1
            self._fetched = self.positions
            return pack_slice(self.keys, 0, self.size), pack_slice(self.values, 0, self.size)
        old_keys, old_values, positions = self.time_order()
        all_keys, all_values = pack_concat([old_keys, new_keys]), pack_concat([old_values, new_values])
        positions += range(self.offset, self.offset + length)
        self.offset += length
        total, keep = len(positions), self.keep
        if total <= self.capacity:
            self.keys, self.values, self.positions = all_keys, all_values, positions
        else:  # the sinks and the newest capacity - keep tokens
            tail = total - (self.capacity - keep)
            self.keys = pack_concat([pack_slice(all_keys, 0, keep), pack_slice(all_keys, tail, total)])
            self.values = pack_concat([pack_slice(all_values, 0, keep), pack_slice(all_values, tail, total)])
            self.positions = positions[:keep] + positions[tail:]
        self.idx = self.size if self.size < self.capacity else keep
        self._fetched = positions
        return all_keys, all_values

    # --- attention -----------------------------------------------------------------------

    def _fetched_blocks(self) -> mx.array | None:
        """The key centers' block of each fetched key (slots are not positions here)."""
        return None if self.codec.key_center is None else mx.array(self._fetched, dtype=mx.int32) // CENTER_BLOCK

    def make_mask(self, query_len: int, window: int | None) -> Mask:
        if self.offset + query_len <= self.max_size:  # nothing evicted: same as the plain cache
            return causal_mask_for(query_len, self.offset + query_len, window)
        if query_len == 1:
            if window is None and self.slack == 0:  # every stored token is visible
                return None
            key_positions = list(self.positions)
            if self.size < self.capacity:
                key_positions.append(self.offset)
            else:
                key_positions[self.idx] = self.offset
        else:
            key_positions = self._time_positions() + list(range(self.offset, self.offset + query_len))
        query_pos = mx.arange(self.offset, self.offset + query_len)[:, None]  # (L, 1)
        key_pos = mx.array(key_positions)[None]  # (1, S)
        return in_window(key_pos <= query_pos, key_pos, query_pos, self.storage, window)

    def _time_positions(self) -> list[int]:
        return [p for a, b in time_spans(self.size, self.capacity, self.keep, self.idx) for p in self.positions[a:b]]

    # --- save / load / trim ---------------------------------------------------------------

    @property
    def state(self) -> tuple[mx.array, ...]:
        if self.keys is None or self.values is None:
            return ()
        keys, values = pack_slice(self.keys, 0, self.size), pack_slice(self.values, 0, self.size)
        return keys + values + self.codec.state + (mx.array(self.positions, dtype=mx.int32),)

    @state.setter
    def state(self, arrays: tuple[mx.array, ...]) -> None:
        """Set after ``meta_state`` (which holds the offset and ring index)."""
        if not arrays:
            self.keys = self.values = None
            self.positions = []
            return
        *packs, positions = arrays
        self.codec, self.keys, self.values = self.codec.unpack(packs)
        self.positions = [int(p) for p in positions.tolist()]

    @property
    def meta_state(self) -> dict[str, str]:
        return {
            "max_size": str(self.max_size), "keep": str(self.keep), **self._codec_meta(),
            "offset": str(self.offset), "idx": str(self.idx), "slack": str(self.slack),
        }

    @meta_state.setter
    def meta_state(self, meta: dict[str, str]) -> None:
        self._configure(int(meta["max_size"]), int(meta["keep"]), *codec_settings(meta), int(meta.get("slack", "0")))
        self.offset, self.idx = int(meta["offset"]), int(meta["idx"])

    def reserve_rewind(self, slack: int) -> None:
        """Keep at least ``slack`` tokens beyond the window from now on (a cache made or loaded
        without them, before speculative decoding). A full ring is laid out in time order first,
        so that the slots it grows by follow the newest token."""
        if slack <= self.slack:
            return
        if self.keys is not None and self.values is not None and self.size == self.capacity:
            self.keys, self.values, self.positions = self.time_order()
        self.slack, self.capacity = slack, self.max_size + slack
        self.idx = self.size

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens. Possible while every token the next query may see is
        still stored: always before any eviction, and with ``slack`` for up to ``slack`` tokens
        after. Otherwise nothing changes and 0 is returned."""
        n = min(n, self.offset)
        if n <= 0 or self.keys is None or self.values is None:
            return 0
        if self.offset == self.size:  # nothing evicted: slot order is time order
            self.positions = self.positions[: self.size - n]
        else:
            keys, values, positions = self.time_order()
            if not takes_back(positions[self.keep], len(positions), self.offset, n, self.max_size, self.keep):
                return 0
            size = len(positions) - n
            self.keys, self.values = pack_slice(keys, 0, size), pack_slice(values, 0, size)
            self.positions = positions[:size]
        self.offset -= n
        self.idx = self.size
        return n
