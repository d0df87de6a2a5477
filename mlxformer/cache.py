"""The KV cache protocol and the plain preallocated cache.

Every cache stores keys/values of shape ``(B, n_kv_heads, S, head_dim)`` for one layer and
knows how to attend over what it stores, so the decoder never inspects cache types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, Sequence, Union

import mlx.core as mx

from .errors import MlxformerError

# The attention mask handed to ``mx.fast.scaled_dot_product_attention``: ``None`` lets every
# query see every key, ``"causal"`` is the lower-right aligned causal mask, an array is explicit.
Mask = Union[None, Literal["causal"], mx.array]


def causal_mask_for(query_len: int, key_len: int, window: int | None = None) -> Mask:
    """The mask for ``query_len`` new queries over ``key_len`` keys, the queries being the last ones.

    With a sliding ``window``, query at position p sees keys in ``(p - window, p]``.
    """
    if window is None or key_len <= window:
        return "causal" if query_len > 1 else None
    query_pos = mx.arange(key_len - query_len, key_len)[:, None]  # (L, 1)
    key_pos = mx.arange(key_len)[None]  # (1, S)
    return (key_pos <= query_pos) & (key_pos > query_pos - window)


class HasLayers(Protocol):
    """Anything with a sequence of decoder layers (the model)."""

    @property
    def layers(self) -> Sequence[Any]: ...


class Cache(Protocol):
    """What the decoder needs from one layer's cache."""

    offset: int  # number of tokens processed so far (the RoPE position of the next token)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        """Store new ``(B, n_kv, L, D)`` keys/values; return everything to attend over."""
        ...

    def attention(self, queries: mx.array, keys: Any, values: Any, scale: float, mask: Mask) -> mx.array:
        """Attend ``(B, n_heads, L, D)`` queries over what ``update_and_fetch`` returned."""
        ...

    def make_mask(self, query_len: int, window: int | None) -> Mask:
        """The mask for the next ``query_len`` queries (called before ``update_and_fetch``)."""
        ...

    @property
    def state(self) -> tuple[mx.array, ...]:
        """Arrays that, with ``meta_state``, restore this cache."""
        ...

    @property
    def meta_state(self) -> dict[str, str]:
        """String settings needed to rebuild this cache."""
        ...

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens; returns how many were forgotten."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache buffers."""
        ...


class KVCache:
    """Keys/values in buffers grown ``step`` tokens at a time and written in place."""

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def _grow(self, keys: mx.array, values: mx.array) -> None:
        B, n_kv, L, k_dim = keys.shape
        v_dim = values.shape[-1]
        n_new = ((L + self.step - 1) // self.step) * self.step
        new_keys = mx.zeros((B, n_kv, n_new, k_dim), keys.dtype)
        new_values = mx.zeros((B, n_kv, n_new, v_dim), values.dtype)
        if self.keys is None or self.values is None:
            self.keys, self.values = new_keys, new_values
        else:
            self.keys = mx.concatenate([self.keys[..., : self.offset, :], new_keys], axis=2)
            self.values = mx.concatenate([self.values[..., : self.offset, :], new_values], axis=2)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        start = self.offset
        if self.keys is None or start + keys.shape[2] > self.keys.shape[2]:
            self._grow(keys, values)
        assert self.keys is not None and self.values is not None
        self.offset += keys.shape[2]
        self.keys[..., start : self.offset, :] = keys
        self.values[..., start : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def attention(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Mask) -> mx.array:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    def make_mask(self, query_len: int, window: int | None) -> Mask:
        return causal_mask_for(query_len, self.offset + query_len, window)

    @property
    def state(self) -> tuple[mx.array, ...]:
        if self.keys is None or self.values is None:
            return ()
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @state.setter
    def state(self, arrays: tuple[mx.array, ...]) -> None:
        if not arrays:
            self.keys = self.values = None
            self.offset = 0
            return
        self.keys, self.values = arrays
        self.offset = self.keys.shape[2]

    @property
    def meta_state(self) -> dict[str, str]:
        return {}

    @meta_state.setter
    def meta_state(self, meta: dict[str, str]) -> None:
        pass

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return self.keys.nbytes + self.values.nbytes


@dataclass(frozen=True)
class CacheSettings:
    """How to build a model's per-layer caches (the defaults give a plain float cache).

    ``kv_bits`` (4 or 8) quantizes keys/values in groups of ``kv_group_size`` once the cache
    holds ``quantized_kv_start`` tokens; ``max_kv_size`` bounds the cache to a rotating window
    that always keeps the first ``keep`` tokens.
    """

    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 0
    max_kv_size: int | None = None
    keep: int = 4


def make_cache(model: "HasLayers", settings: CacheSettings | None = None) -> list[Cache]:
    """One cache per decoder layer, as ``settings`` asks."""
    from .cache_quantized import QuantizedKVCache, check_kv_quantization
    from .cache_rotating import RotatingKVCache

    settings = settings or CacheSettings()
    bits, group, start = settings.kv_bits, settings.kv_group_size, settings.quantized_kv_start
    if bits is not None:
        check_kv_quantization(bits, group)
    if start < 0:
        raise MlxformerError("quantized_kv_start must be >= 0")
    if settings.max_kv_size is not None:
        if settings.max_kv_size < 1:
            raise MlxformerError("max_kv_size must be positive")
        keep = min(settings.keep, settings.max_kv_size - 1)
        return [RotatingKVCache(settings.max_kv_size, keep, bits, group, start) for _ in model.layers]
    if bits is not None:
        return [QuantizedKVCache(bits, group, start) for _ in model.layers]
    return [KVCache() for _ in model.layers]
