"""KV caches behind one protocol (``protocol.py``): a sequence's own caches (``kv.py``: growing,
float or quantized through ``codec.py``; ``rotating.py``: a window; ``latent.py``: MLA's
latents; ``state.py``: a Gated DeltaNet layer's state), a sequence's row of the engine's decode
batch from admission on (``rows.py``, ``rotating_rows.py``, ``state_rows.py``, ``row_place.py``
over ``batch.py`` / ``batch_kind.py``), one packed step's view (``packed.py``), a cache cut into
prompt-cache blocks and rebuilt from them (``blocks.py``), and prompt-cache files (``files.py``,
``file_checks.py``).

``make_cache`` builds one cache per decoder layer from ``CacheSettings``.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxformer.cache.codec import check_kv_quantization
from mlxformer.cache.kv import KVCache
from mlxformer.cache.protocol import Cache, HasLayers
from mlxformer.cache.rotating import RotatingKVCache
from mlxformer.cache.state import StateCache
from mlxformer.errors import MlxformerError

__all__ = ["Cache", "CacheSettings", "KVCache", "RotatingKVCache", "StateCache", "make_cache"]


@dataclass(frozen=True)
class CacheSettings:
    """How to build a model's per-layer caches (the defaults give a plain float cache).

    ``kv_bits`` (4 or 8) quantizes keys/values in groups of ``kv_group_size`` once the cache
    holds ``quantized_kv_start`` tokens; ``max_kv_size`` bounds the cache to a rotating window
    that always keeps the first ``keep`` tokens. A sliding-window layer (Mistral's, Gemma's
    local ones) always gets a rotating cache of its window without sinks, unless
    ``max_kv_size`` is smaller; a global layer a growing one; a recurrent (Gated DeltaNet)
    layer a ``StateCache`` (never quantized, fixed size).
    """

    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 0
    max_kv_size: int | None = None
    keep: int = 4
    rewind: int = 0  # tokens a rotating cache keeps beyond its window, to be trimmed (speculative decoding)


def make_cache(model: HasLayers, settings: CacheSettings | None = None) -> list[Cache]:
    """One cache per decoder layer with a cache of its own (``cache_layers``), as ``settings``
    asks and each layer's window needs."""
    settings = settings or CacheSettings()
    bits, group, start = settings.kv_bits, settings.kv_group_size, settings.quantized_kv_start
    if bits is not None:
        check_kv_quantization(bits, group)
    if start < 0:
        raise MlxformerError("quantized_kv_start must be >= 0")
    if settings.max_kv_size is not None and settings.max_kv_size < 1:
        raise MlxformerError("max_kv_size must be positive")
    return [StateCache(settings.rewind) if layer.recurrent else _layer_cache(layer.window, settings)
            for layer in model.cache_layers]


def _layer_cache(window: int | None, settings: CacheSettings) -> Cache:
    """The cache of one layer attending with ``window`` (None: the whole context)."""
    bits, group, start = settings.kv_bits, settings.kv_group_size, settings.quantized_kv_start
    if window is not None and (settings.max_kv_size is None or settings.max_kv_size >= window):
        # The layer never attends further back than its window: keep exactly the window
        # (no sinks), so memory stays bounded and the logits are those of the full cache.
        return RotatingKVCache(window, 0, bits, group, start, settings.rewind)
    if settings.max_kv_size is not None:
        keep = min(settings.keep, settings.max_kv_size - 1)
        return RotatingKVCache(settings.max_kv_size, keep, bits, group, start, settings.rewind)
    return KVCache(bits, group, start)
