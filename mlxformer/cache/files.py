"""Prompt cache files: a prefilled KV cache saved to safetensors.

A file holds, per layer, the cache's ``state`` arrays (``layer.{i}.{j}``) and, as string
metadata, its class name, ``meta_state``, the cached token ids, an optional chat conversation
and the model config it was made with. Classes are rebuilt only from ``CACHE_CLASSES``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import mlx.core as mx

from mlxformer.cache import CacheSettings, make_cache
from mlxformer.cache.protocol import Cache
from mlxformer.cache.kv import KVCache
from mlxformer.cache.rotating import RotatingKVCache
from mlxformer.errors import MlxformerError
from mlxformer.generation import prefill
from mlxformer.models.decoder import Model

FORMAT = "mlxformer-prompt-cache"
VERSION = "1"

CACHE_CLASSES: dict[str, type] = {
    "KVCache": KVCache,
    "QuantizedKVCache": KVCache,  # written by version 0.1 files; the same class since
    "RotatingKVCache": RotatingKVCache,
}


@dataclass
class PromptCacheFile:
    """What a prompt cache file restores."""

    cache: list[Cache]
    token_ids: list[int]
    messages: list[dict[str, str]] = field(default_factory=list)


def model_fingerprint(model: Model) -> str:
    """The model config as canonical JSON; a cache only fits a model with the same one."""
    return json.dumps(dataclasses.asdict(model.args), sort_keys=True)


def save_prompt_cache(
    path: str | Path,
    cache: Sequence[Cache],
    token_ids: Sequence[int],
    model: Model,
    *,
    messages: Sequence[dict[str, str]] = (),
    overwrite: bool = True,
) -> None:
    """Write ``cache`` and the ``token_ids`` it holds to ``path`` atomically (temp file, then rename)."""
    path = Path(path)
    if not overwrite and path.exists():
        raise MlxformerError(f"{path} already exists (use --force to overwrite)")
    if not cache or cache[0].offset == 0:
        raise MlxformerError("the cache is empty: nothing to save")
    if len(token_ids) != cache[0].offset:
        raise MlxformerError(f"{len(token_ids)} token ids given for a cache holding {cache[0].offset} tokens")
    unknown = {type(c).__name__ for c in cache} - set(CACHE_CLASSES)
    if unknown:
        raise MlxformerError(f"cannot save cache class {sorted(unknown)[0]}")
    arrays = {f"layer.{i}.{j}": array for i, c in enumerate(cache) for j, array in enumerate(c.state)}
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "model_config": model_fingerprint(model),
        "classes": json.dumps([type(c).__name__ for c in cache]),
        "meta_states": json.dumps([c.meta_state for c in cache]),
        "token_ids": json.dumps([int(t) for t in token_ids]),
        "messages": json.dumps(list(messages)),
    }
    mx.eval(list(arrays.values()))
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".safetensors")
    os.close(fd)
    try:
        mx.save_safetensors(tmp, arrays, metadata)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_prompt_cache_file(path: str | Path, model: Model) -> PromptCacheFile:
    """Rebuild the cache, token ids and conversation saved in ``path`` for ``model``."""
    path = Path(path)
    if not path.is_file():
        raise MlxformerError(f"prompt cache file not found: {path}")
    try:
        arrays, metadata = mx.load(str(path), return_metadata=True)
    except Exception:
        raise MlxformerError(f"cannot read prompt cache file {path}: corrupt or not a safetensors file") from None
    if metadata.get("format") != FORMAT:
        raise MlxformerError(f"{path} is not an mlxformer prompt cache file")
    if metadata.get("model_config") != model_fingerprint(model):
        raise MlxformerError(f"prompt cache file {path} was made for a different model config")
    try:
        classes = json.loads(metadata["classes"])
        meta_states = json.loads(metadata["meta_states"])
        token_ids = [int(t) for t in json.loads(metadata["token_ids"])]
        messages = json.loads(metadata.get("messages", "[]"))
        if len(classes) != len(model.layers) or len(meta_states) != len(classes):
            raise ValueError("layer count")
        cache = [_rebuild(i, name, meta, arrays) for i, (name, meta) in enumerate(zip(classes, meta_states))]
    except (KeyError, ValueError, TypeError):
        raise MlxformerError(f"prompt cache file {path} is corrupt") from None
    if cache[0].offset != len(token_ids):
        raise MlxformerError(f"prompt cache file {path} is corrupt")
    return PromptCacheFile(cache, token_ids, messages)


def _rebuild(layer: int, name: str, meta: dict[str, str], arrays: dict[str, mx.array]) -> Cache:
    cls = CACHE_CLASSES.get(name)
    if cls is None:
        raise MlxformerError(f"unknown cache class {name!r} in prompt cache file")
    count = 0
    while f"layer.{layer}.{count}" in arrays:
        count += 1
    cache: Cache = cls()
    cache.meta_state = meta  # type: ignore[misc]
    cache.state = tuple(arrays[f"layer.{layer}.{j}"] for j in range(count))  # type: ignore[misc]
    return cache


def load_prompt_cache(path: str | Path, model: Model) -> tuple[list[Cache], list[int]]:
    """The saved cache and the token ids it holds."""
    loaded = load_prompt_cache_file(path, model)
    return loaded.cache, loaded.token_ids


def strip_cached_prefix(ids: Sequence[int], cached_ids: Sequence[int]) -> list[int]:
    """The ids still to prefill: ``ids`` minus the cached prefix, or all of them to append after it."""
    ids, cached_ids = list(ids), list(cached_ids)
    if ids[: len(cached_ids)] != cached_ids:
        return ids
    if len(ids) == len(cached_ids):
        raise MlxformerError("the prompt is entirely in the prompt cache; add text after the cached prompt")
    return ids[len(cached_ids):]


def cache_prompt(
    path: str | Path, model: Model, token_ids: Sequence[int], settings: CacheSettings | None = None,
    *, overwrite: bool = False,
) -> list[Cache]:
    """Prefill ``token_ids`` into a new cache and save it to ``path``; returns the cache."""
    cache = make_cache(model, settings)
    prefill(model, mx.array(list(token_ids)), cache)
    mx.eval([c.state for c in cache])
    save_prompt_cache(path, cache, token_ids, model, overwrite=overwrite)
    return cache
