"""The growing KV cache, float or quantized, written in place in preallocated blocks; and what it
shares with the rotating cache (``OwnCache``)."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from mlxformer.cache.batch_kind import Held, StorageKind
from mlxformer.cache.codec import (
    FLOAT_CODEC, KVCodec, Pack, check_kv_quantization, codec_settings, pack_concat, pack_nbytes, pack_slice, quantized_at,
    pack_write, pack_zeros_like,
)
from mlxformer.cache.latent import Expand, latent_attention
from mlxformer.models.mask import Mask, causal_mask_for


class CodecAttention:
    """Attention over what a cache's ``codec`` stores (float, quantized, a latent): the part of the
    cache protocol that a sequence's own cache and its row of a batch share."""

    segments = None  # the rows of one forward (``Cache.segments``)

    codec: KVCodec

    def _fetched_blocks(self) -> mx.array | None:
        """The key-center block of each key ``update_and_fetch`` returned (``KVCodec.attention``'s
        ``key_blocks``); None: key ``s`` is at position ``s``."""
        return None

    def attention(
        self, queries: mx.array, keys: Pack, values: Pack, scale: float, mask: Mask, softcap: float | None = None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        return self.codec.attention(queries, keys, values, scale, mask, softcap, self._fetched_blocks(), sinks)

    def latent_attention(
        self, q_latent: mx.array, q_rope: mx.array, keys: Pack, values: Pack, scale: float, mask: Mask
    ) -> mx.array:
        return latent_attention(self.codec, q_latent, q_rope, keys, values, scale, mask, self._fetched_blocks())

    def expanded_attention(
        self, q_nope: mx.array, q_rope: mx.array, keys: Pack, values: Pack, mask: Mask, expand: Expand
    ) -> mx.array:
        return expand(q_nope, q_rope, keys[0], values[0], mask)  # float: the fetched keys in time order


class OwnCache(CodecAttention):
    """What a sequence's own growing and rotating caches share: their storage settings, the codec
    their keys/values are stored with (float, or with ``bits`` quantized once they hold ``start``
    tokens), their buffers, grown ``step`` tokens at a time, and their ``meta_state`` fields."""

    step = 256

    def _configure_storage(self, bits: int | None, group_size: int, start: int, quantized: bool) -> None:
        if bits is not None:
            check_kv_quantization(bits, group_size)
        self.bits, self.group_size, self.start = bits, group_size, start
        self.codec = KVCodec(bits, group_size) if quantized else FLOAT_CODEC
        self.keys: Pack | None = None
        self.values: Pack | None = None
        self.offset = 0

    @property
    def quantized(self) -> bool:
        """Whether the stored keys/values are quantized yet."""
        return self.codec.bits is not None

    @property
    def _quantize_due(self) -> bool:
        """Whether the next update turns the storage quantized (the cache holds ``start`` tokens)."""
        return not self.quantized and quantized_at(self.offset + 1, self.bits, self.start)

    def _held(self) -> Sequence[int]:
        """The absolute position of each stored slot, in slot order."""
        raise NotImplementedError

    @property
    def storage(self) -> StorageKind:
        """The pool a sequence with this cache takes a row in (``cache/batch_kind.py``)."""
        raise NotImplementedError

    def time_order(self) -> tuple[Pack, Pack, list[int]]:
        """The stored keys, values and their positions, oldest first."""
        raise NotImplementedError

    @property
    def meta_state(self) -> dict[str, str]:
        raise NotImplementedError

    def held(self) -> Held:
        """What the cache holds, oldest first, as data (``Held``)."""
        empty = self.keys is None or self.values is None or not self.offset
        return Held(self.storage, self.meta_state, int(self.offset), *(() if empty else self.time_order()), codec=self.codec)

    def quantize_storage(self) -> None:
        """Re-encode what the cache holds into quantized storage (at ``quantized_kv_start``; a
        pool row crossing it is re-encoded as data instead, ``Held.quantized``)."""
        assert self.bits is not None
        self.codec, float_codec = KVCodec(self.bits, self.group_size), self.codec
        if self.keys is not None and self.values is not None:
            held = self._held()
            keys, values = (float_codec.decode(pack_slice(x, 0, len(held))) for x in (self.keys, self.values))
            self.codec, self.keys, self.values = self.codec.store(keys, values, held)

    def _store(self, keys: mx.array, values: mx.array, positions: Sequence[int]) -> tuple[Pack, Pack]:
        """New float ``keys``/``values`` at ``positions`` as the cache stores them (quantizing what
        it holds first when ``start`` is reached); the first update makes empty buffers."""
        if self._quantize_due:
            self.quantize_storage()
        self.codec, new_keys, new_values = self.codec.store(keys, values, positions)
        if self.keys is None or self.values is None:
            self.keys, self.values = pack_zeros_like(new_keys, 0), pack_zeros_like(new_values, 0)
        return new_keys, new_values

    def _grow(self, held: int, extra: int) -> None:
        """Keep the buffers' first ``held`` slots and add ``extra`` zero slots after them."""
        assert self.keys is not None and self.values is not None
        self.keys = pack_concat([pack_slice(self.keys, 0, held), pack_zeros_like(self.keys, extra)])
        self.values = pack_concat([pack_slice(self.values, 0, held), pack_zeros_like(self.values, extra)])

    def _codec_meta(self) -> dict[str, str]:
        """The ``meta_state`` fields ``codec_settings`` reads back."""
        return {
            "bits": "" if self.bits is None else str(self.bits), "group_size": str(self.group_size),
            "start": str(self.start), "quantized": str(int(self.quantized)),
        }

    @property
    def nbytes(self) -> int:
        return pack_nbytes(self.keys) + pack_nbytes(self.values)


class KVCache(OwnCache):
    """A growing KV cache, written in place in buffers grown ``step`` tokens at a time.

    ``bits=None`` stores float keys/values. With ``bits`` (4 or 8) it stores them quantized in
    groups of ``group_size``; with ``start > 0`` it stores float until it holds ``start``
    tokens, then quantizes what it has at the beginning of the next ``update_and_fetch``.
    """

    def __init__(self, bits: int | None = None, group_size: int = 64, start: int = 0) -> None:
        self._configure_storage(bits, group_size, start, quantized=bits is not None and start <= 0)

    def _held(self) -> Sequence[int]:
        return range(self.offset)

    @property
    def storage(self) -> StorageKind:
        return StorageKind(False, None, None, 0, self.codec.bits, self.group_size)

    def time_order(self) -> tuple[Pack, Pack, list[int]]:
        assert self.keys is not None and self.values is not None
        return pack_slice(self.keys, 0, self.offset), pack_slice(self.values, 0, self.offset), list(range(self.offset))

    def reserve_rewind(self, slack: int) -> None:
        """Nothing to keep: a growing cache can always take its last tokens back."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Pack, Pack]:
        start, length = self.offset, keys.shape[2]
        new_keys, new_values = self._store(keys, values, range(start, start + length))
        self.reserve(length)
        assert self.keys is not None and self.values is not None
        pack_write(self.keys, start, new_keys)
        pack_write(self.values, start, new_values)
        self.offset += length
        return pack_slice(self.keys, 0, self.offset), pack_slice(self.values, 0, self.offset)

    def reserve(self, length: int) -> bool:
        """Make the buffers hold ``length`` more tokens (grown by whole steps past the offset, as
        ``update_and_fetch`` grows them); returns whether they were rewritten (lazily: the engine
        evaluates one layer's growth at a time, so only one layer's old buffers are ever held
        beside the new ones). Nothing to do before the first update or before the update that
        turns the storage quantized (which rewrites the buffers itself)."""
        if self.keys is None or self.values is None or self.offset + length <= self.keys[0].shape[2]:
            return False
        if self._quantize_due:
            return False
        self._grow(self.offset, ((length + self.step - 1) // self.step) * self.step)
        return True

    def make_mask(self, query_len: int, window: int | None) -> Mask:
        return causal_mask_for(query_len, self.offset + query_len, window)

    @property
    def state(self) -> tuple[mx.array, ...]:
        if self.keys is None or self.values is None:
            return ()
        return pack_slice(self.keys, 0, self.offset) + pack_slice(self.values, 0, self.offset) + self.codec.state

    @state.setter
    def state(self, arrays: tuple[mx.array, ...]) -> None:
        """Set after ``meta_state`` (which says whether the arrays are quantized)."""
        if not arrays:
            self.keys = self.values = None
            self.offset = 0
            return
        self.codec, self.keys, self.values = self.codec.unpack(arrays)
        self.offset = self.keys[0].shape[2]

    @property
    def meta_state(self) -> dict[str, str]:
        return self._codec_meta()

    @meta_state.setter
    def meta_state(self, meta: dict[str, str]) -> None:
        self._configure_storage(*codec_settings(meta))

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n
