"""Building the engine's tiered prompt cache from its settings: the memory tier, and the disk
tier when a directory is given, both keyed by the model's fingerprint."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxformer.cache import CacheSettings
from mlxformer.generation.prompt_cache_files import fingerprint
from mlxformer.engine.disk_cache import DiskBlockStore
from mlxformer.engine.prefix_cache import BLOCK_SIZE, PrefixCache
from mlxformer.errors import MlxformerError
from mlxformer.models.decoder import Model
from mlxformer.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class PromptCacheSettings:
    """The prompt cache's tiers: ``memory_bytes`` in memory (LRU), then, with ``directory``, up
    to ``disk_bytes`` of block files there (LRU); ``block_size`` tokens per block;
    ``share_prefills``: a newcomer waits for the blocks it shares with a prompt being prefilled
    instead of computing them too (``prefix_sharing.py``)."""

    memory_bytes: int = 512 * 2**20
    directory: str | None = None
    disk_bytes: int = 4 * 2**30
    block_size: int = BLOCK_SIZE
    share_prefills: bool = True  # a newcomer waits for the blocks it shares with a prompt being prefilled

    def __post_init__(self) -> None:
        if self.memory_bytes < 0 or self.disk_bytes < 0:
            raise MlxformerError("prompt cache sizes must be >= 0 bytes")
        if self.block_size < 1:
            raise MlxformerError("the prompt cache block size must be >= 1 token")


def build_prefix_cache(model: Model, tokenizer: Tokenizer, cache_settings: CacheSettings,
                       settings: PromptCacheSettings, kv_dtype: mx.Dtype) -> PrefixCache:
    """The prefix cache for ``model`` whose caches are made with ``cache_settings`` and hold
    ``kv_dtype`` floats. Its chain seed (and every disk file) names the model, tokenizer, weights,
    quantization, cache settings, KV dtype and block size."""
    identity: dict[str, str] = {}
    seed = ""
    if settings.directory is not None or settings.memory_bytes > 0:
        fields, samples = fingerprint(model, tokenizer)
        identity = {
            **fields,
            "weight_samples": hashlib.sha256(np.asarray(samples).tobytes()).hexdigest(),
            "cache_settings": json.dumps(dataclasses.asdict(cache_settings), sort_keys=True),
            "kv_dtype": str(kv_dtype), "block_size": str(settings.block_size),
        }
        seed = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    disk = None
    if settings.directory is not None:
        disk = DiskBlockStore(settings.directory, settings.disk_bytes, identity, model.args, kv_dtype,
                              settings.block_size, [layer.recurrent for layer in model.layers])
    return PrefixCache(settings.memory_bytes, model, cache_settings, seed=seed, block_size=settings.block_size,
                       disk=disk)
