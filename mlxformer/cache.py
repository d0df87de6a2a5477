"""The KV cache protocol, the cache settings and ``make_cache``.

Every cache stores keys/values of shape ``(B, n_kv_heads, S, head_dim)`` for one layer and
knows how to attend over what it stores, so the decoder never inspects cache types.
The growing (float or quantized) cache is in ``cache_quantized``, the bounded window in
``cache_rotating``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import mlx.core as mx

from .attention_mask import Mask

from .errors import MlxformerError

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
    from .cache_quantized import KVCache, QuantizedKVCache, check_kv_quantization
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
