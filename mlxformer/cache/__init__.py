"""KV caches behind one protocol, and ``make_cache``, which builds one cache per decoder layer from
``CacheSettings``.

- ``protocol.py``: ``Cache``, what the decoder needs from one layer's cache.
- A sequence's own caches (a single stream: ``generate``, ``chat``, ``bench``, distributed):
  ``kv.py`` (``KVCache``: growing, float or quantized; ``OwnCache``: what it shares with the
  rotating cache), ``rotating.py`` (``RotatingKVCache``: a window with sinks), ``state.py``
  (``StateCache``: a Gated DeltaNet layer's fixed-size state); ``codec.py`` (how keys/values
  are stored: float, or quantized with a Hadamard rotation, and attended that way) and
  ``latent.py`` (MLA's latents held in an ordinary cache, and the attention over them).
- The engine's KV pool, where a sequence lives in a row from admission to retirement:
  ``pool.py`` (``KVPool``: the pool of one storage kind; ``blanks``: the slot shapes it allocates),
  ``batch.py`` (``BatchLayout``: which position each slot of each row holds, ``BatchLayerCache``:
  one layer's buffers and decode step), ``batch_kind.py`` (``StorageKind``/``PoolKey``: what
  rows of one pool share, ``BatchRow``: a row's place), ``rotating_rows.py`` (a rotating cache's
  ring in a row), ``state_rows.py`` (recurrent layers' rows), ``row_place.py`` (what a row's
  layer views of every kind share, and ``RowCache``: one layer of one row), ``rewrite.py`` (a
  layer's rewrite evaluated and its old buffers freed at once, under a KV budget).
- ``packed.py``: ``PackedLayerCache``, one engine step's decode rows and prompt chunks in one
  forward, each segment written to and attended over by its own cache.
- ``blocks.py``: a cache cut into hash-chained token blocks and caches rebuilt from them (the
  prompt cache's storage).
- ``file_checks.py``: the checks of a stored layer (prompt-cache files,
  ``generation/prompt_cache_files.py``, and the prefix cache's disk tier)."""

from __future__ import annotations

from dataclasses import dataclass

from mlxformer.cache.batch_kind import Held
from mlxformer.cache.codec import check_kv_quantization
from mlxformer.cache.kv import KVCache
from mlxformer.cache.protocol import Cache, HasLayers
from mlxformer.cache.rotating import RotatingKVCache
from mlxformer.cache.state import StateCache
from mlxformer.errors import OptionError

__all__ = ["Cache", "CacheSettings", "KVCache", "RotatingKVCache", "StateCache", "make_cache", "new_held"]


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

    def __post_init__(self) -> None:
        """The one check of these settings (an ``OptionError`` naming the field: the command line
        names its flag)."""
        if self.kv_bits is not None:
            check_kv_quantization(self.kv_bits, self.kv_group_size)
        if self.quantized_kv_start < 0:
            raise OptionError("quantized_kv_start", "must be >= 0")
        if self.max_kv_size is not None and self.max_kv_size <= self.keep:
            raise OptionError("max_kv_size", f"must be larger than the {self.keep} first tokens the window always "
                                             f"keeps (got {self.max_kv_size})")


def make_cache(model: HasLayers, settings: CacheSettings | None = None) -> list[Cache]:
    """One cache per decoder layer with a cache of its own (``cache_layers``), as ``settings``
    asks and each layer's window needs."""
    settings = settings or CacheSettings()
    return [StateCache(settings.rewind) if layer.recurrent else _layer_cache(layer.window, settings)
            for layer in model.cache_layers]


def new_held(model: HasLayers, settings: CacheSettings | None = None) -> list[Held]:
    """What a new sequence's layers hold (nothing yet), each with the storage and settings
    ``make_cache`` gives it: a seat's empty row, the template of a prefix hit's layers."""
    return [c.held() for c in make_cache(model, settings)]


def _layer_cache(window: int | None, settings: CacheSettings) -> Cache:
    """The cache of one layer attending with ``window`` (None: the whole context)."""
    bits, group, start = settings.kv_bits, settings.kv_group_size, settings.quantized_kv_start
    if window is not None and (settings.max_kv_size is None or settings.max_kv_size >= window):
        # The layer never attends further back than its window: keep exactly the window
        # (no sinks), so memory stays bounded and the logits are those of the full cache.
        return RotatingKVCache(window, 0, bits, group, start, settings.rewind)
    if settings.max_kv_size is not None:
        return RotatingKVCache(settings.max_kv_size, settings.keep, bits, group, start, settings.rewind)
    return KVCache(bits, group, start)

