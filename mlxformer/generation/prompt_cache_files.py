"""Prompt cache files: a prefilled KV cache saved to safetensors.

A file holds, per layer, the cache's ``state`` arrays (``layer.{i}.{j}``) and, as string
metadata, its class name, ``meta_state``, the cached token ids, an optional chat conversation
and the fingerprint of the model it was made with: config, per-layer quantization, a slice of
every weight and a hash of the tokenizer's vocabulary. Classes are rebuilt only from
``CACHE_CLASSES``, after ``file_checks`` has checked every field and array against the model.
Files are safetensors whatever their name, written atomically with the umask's permissions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxformer.adapters.layers import cache_salt
from mlxformer.cache import CacheSettings, make_cache
from mlxformer.cache.file_checks import check_layer
from mlxformer.cache.protocol import Cache
from mlxformer.cache.kv import KVCache
from mlxformer.cache.rotating import RotatingKVCache
from mlxformer.cache.state import StateCache
from mlxformer.errors import MlxformerError
from mlxformer.generation.stream import prefill
from mlxformer.models.decoder import Model
from mlxformer.text.tokenizer import Tokenizer

FORMAT = "mlxformer-prompt-cache"
VERSION = "3"  # 2: the fingerprint covers quantization, weights and tokenizer; 3: weight samples
WEIGHT_SAMPLE = 64  # leading elements of each weight in the fingerprint
SAMPLES_KEY = "fingerprint.weights"  # the float weight samples, an array beside the cache's
# A float weight sample matches within one bfloat16 step (plus float16's subnormal step), the
# rounding a cast of the same checkpoint to another compute dtype makes.
SAMPLE_RTOL, SAMPLE_ATOL = 2.0**-7, 2.0**-24

CACHE_CLASSES: dict[str, type] = {"KVCache": KVCache, "RotatingKVCache": RotatingKVCache, "StateCache": StateCache}


@dataclass
class PromptCacheFile:
    """What a prompt cache file restores."""

    cache: list[Cache]
    token_ids: list[int]
    messages: list[dict[str, str]] = field(default_factory=list)


def model_fingerprint(model: Model) -> str:
    """The model config as canonical JSON; a cache only fits a model with the same one."""
    return json.dumps(dataclasses.asdict(model.args), sort_keys=True)


def quantization_fingerprint(model: Model) -> str:
    """Canonical JSON of each quantized layer's ``[bits, group_size, mode]`` (``{}`` for a float
    model). Private modules (views of other layers' arrays, such as the CPU-sharded output
    projection) are skipped, so the thread count does not change it."""
    layers = {
        name: [module.bits, module.group_size, module.mode]
        for name, module in model.named_modules()
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        and not any(part.startswith("_") for part in name.split("."))
    }
    return json.dumps(layers, sort_keys=True)


def weights_fingerprint(model: Model) -> tuple[str, mx.array]:
    """The first ``WEIGHT_SAMPLE`` values of every parameter: they tell apart models of equal
    shapes, such as a base model and its instruct tune. Returns the SHA-256 of every name,
    shape and integer sample (packed quantized weights), and the float samples as one float32
    array ``(n,)``, compared within ``SAMPLE_RTOL`` (see ``samples_match``): a float16, bfloat16
    or float32 copy of the same checkpoint matches, which no hash of rounded values guarantees."""
    digest = hashlib.sha256()
    exact, floats = [], []
    for name, array in sorted(tree_flatten(model.parameters()), key=lambda item: item[0]):
        sample = array.reshape(-1)[:WEIGHT_SAMPLE]  # (n,)
        is_float = mx.issubdtype(sample.dtype, mx.floating)
        (floats if is_float else exact).append(sample.astype(mx.float32) if is_float else sample)
        digest.update(f"{name}{tuple(array.shape)}{'float' if is_float else array.dtype}".encode())
    mx.eval(exact, floats)
    for sample in exact:
        digest.update(memoryview(sample).tobytes())
    return digest.hexdigest(), mx.concatenate(floats) if floats else mx.zeros((0,), mx.float32)


def samples_match(saved: mx.array, current: mx.array) -> bool:
    """Whether two float weight samples are the same weights up to a compute-dtype rounding."""
    if saved.shape != current.shape or saved.dtype != mx.float32:
        return False
    bound = SAMPLE_RTOL * mx.maximum(mx.abs(saved), mx.abs(current)) + SAMPLE_ATOL
    return bool(mx.all(mx.abs(saved - current) <= bound).item())


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """SHA-256 of the vocabulary (every id's token string, in id order)."""
    backend = tokenizer.backend
    tokens = (backend.id_to_token(i) or "" for i in range(tokenizer.vocab_size))
    return hashlib.sha256("\0".join(tokens).encode("utf-8", "surrogatepass")).hexdigest()


def fingerprint(model: Model, tokenizer: Tokenizer) -> tuple[dict[str, str], mx.array]:
    """What a prompt cache file must match to be used: metadata key -> value, and the float
    weight samples (``weights_fingerprint``)."""
    weights, samples = weights_fingerprint(model)
    if salt := cache_salt(model, None):  # an adapter applied to every forward (``--adapter``): its content too
        weights = hashlib.sha256((weights + salt).encode()).hexdigest()
    return {
        "model_config": model_fingerprint(model),
        "quantization": quantization_fingerprint(model),
        "weights": weights,
        "tokenizer": tokenizer_fingerprint(tokenizer),
    }, samples


_MISMATCH = {"model_config": "config"}  # a fingerprint key -> the word a mismatch names (else the key)


def save_prompt_cache(
    path: str | Path,
    cache: Sequence[Cache],
    token_ids: Sequence[int],
    model: Model,
    tokenizer: Tokenizer,
    *,
    messages: Sequence[dict[str, str]] = (),
    overwrite: bool = True,
) -> None:
    """Write ``cache`` and the ``token_ids`` it holds to exactly ``path`` (any name) atomically
    (temp file, then rename), with the fingerprint of ``model`` and ``tokenizer``."""
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
    keys, arrays[SAMPLES_KEY] = fingerprint(model, tokenizer)
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        **keys,
        "classes": json.dumps([type(c).__name__ for c in cache]),
        "meta_states": json.dumps([c.meta_state for c in cache]),
        "token_ids": json.dumps([int(t) for t in token_ids]),
        "messages": json.dumps(list(messages)),
    }
    mx.eval(list(arrays.values()))
    # Created like any file (0666 less the umask), under a name no one else uses, then renamed.
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.safetensors"
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        mx.save_safetensors(tmp, arrays, metadata)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_prompt_cache_file(
    path: str | Path, model: Model, tokenizer: Tokenizer, settings: CacheSettings | None = None
) -> PromptCacheFile:
    """Rebuild the cache, token ids and conversation saved in ``path`` for ``model`` and
    ``tokenizer``. Cache ``settings`` given explicitly (not at their defaults) must be those
    of the file's cache; the ones left at their defaults take the file's."""
    path = Path(path)
    if not path.is_file():
        raise MlxformerError(f"prompt cache file not found: {path}")
    try:
        arrays, metadata = mx.load(str(path), format="safetensors", return_metadata=True)
    except Exception:
        raise MlxformerError(f"cannot read prompt cache file {path}: corrupt or not a safetensors file") from None
    if metadata.get("format") != FORMAT:
        raise MlxformerError(f"{path} is not an mlxformer prompt cache file")
    if metadata.get("version") != VERSION:
        raise MlxformerError(f"prompt cache file {path} is from another mlxformer version: make it again")
    keys, samples = fingerprint(model, tokenizer)
    for key, value in keys.items():
        if metadata.get(key) != value:
            raise MlxformerError(f"prompt cache file {path} was made for a different model {_MISMATCH.get(key, key)}")
    if SAMPLES_KEY not in arrays or not samples_match(arrays.pop(SAMPLES_KEY), samples):
        raise MlxformerError(f"prompt cache file {path} was made for a different model weights")
    try:
        classes = json.loads(metadata["classes"])
        meta_states = json.loads(metadata["meta_states"])
        token_ids = json.loads(metadata["token_ids"])
        messages = json.loads(metadata.get("messages", "[]"))
    except (KeyError, ValueError):
        raise MlxformerError(f"prompt cache file {path} is corrupt: missing or unreadable metadata") from None
    token_ids = _check_fields(path, classes, meta_states, token_ids, messages, model, tokenizer)
    layers = [[arrays.pop(f"layer.{i}.{j}") for j in range(_count(arrays, i))] for i in range(len(classes))]
    if arrays:
        raise MlxformerError(f"prompt cache file {path}: unexpected array {sorted(arrays)[0]!r}")
    for i, (name, meta, state) in enumerate(zip(classes, meta_states, layers)):
        check_layer(path, i, name, meta, state, model.args, len(token_ids))
    cache = [_rebuild(name, meta, state) for name, meta, state in zip(classes, meta_states, layers)]
    if settings is not None:
        check_cache_settings(path, cache, model, settings)
    return PromptCacheFile(cache, token_ids, messages)


def check_cache_settings(path: str | Path, cache: Sequence[Cache], model: Model, settings: CacheSettings) -> None:
    """Refuse cache settings given explicitly (not at their defaults) that ``cache`` does not have."""
    default = CacheSettings()
    first = next((i for i, layer in enumerate(model.cache_layers) if not layer.recurrent), 0)  # a KV layer
    wanted, got = make_cache(model, settings)[first], cache[first]
    keys: list[str] = []
    if settings.kv_bits != default.kv_bits or (settings.kv_bits and settings.kv_group_size != default.kv_group_size):
        keys += ["bits", "group_size"] if settings.kv_bits else ["bits"]
    if settings.quantized_kv_start != default.quantized_kv_start:
        keys.append("start")
    if settings.max_kv_size != default.max_kv_size:
        keys.append("max_size")
    want_meta, got_meta = wanted.meta_state, got.meta_state
    for key in keys:
        if want_meta.get(key) != got_meta.get(key):
            raise MlxformerError(
                f"prompt cache file {path} holds a cache with {_describe(got_meta)}, which conflicts with the "
                f"requested {_describe(want_meta)}: leave the cache settings unset to use the file's"
            )


def _describe(meta: dict[str, str]) -> str:
    """A cache's settings in ``CacheSettings`` words."""
    bits = meta.get("bits") or None
    parts = [f"kv_bits={bits}"]
    if bits:
        parts += [f"kv_group_size={meta.get('group_size')}", f"quantized_kv_start={meta.get('start')}"]
    parts.append(f"max_kv_size={meta.get('max_size')}")
    return ", ".join(parts)


def _check_fields(
    path: Path, classes: Any, meta_states: Any, token_ids: Any, messages: Any, model: Model, tokenizer: Tokenizer
) -> list[int]:
    """The file-wide fields: one class and meta_state per layer, token ids in the vocabulary."""
    where = f"prompt cache file {path}"
    layers = model.cache_layers  # the layers with caches of their own
    if not isinstance(classes, list) or len(classes) != len(layers):
        raise MlxformerError(f"{where}: 'classes' must list one cache class per layer ({len(layers)})")
    if not isinstance(meta_states, list) or len(meta_states) != len(classes):
        raise MlxformerError(f"{where}: 'meta_states' must hold one object per layer ({len(layers)})")
    if unknown := sorted({str(c) for c in classes} - set(CACHE_CLASSES)):
        raise MlxformerError(f"{where}: unknown cache class {unknown[0]!r}")
    if any((c == "StateCache") != layer.recurrent for c, layer in zip(classes, layers)):
        raise MlxformerError(f"{where}: the cache classes do not fit the model's attention and recurrent layers")
    kv_layers = [(c, m) for c, m, layer in zip(classes, meta_states, layers) if not layer.recurrent]
    if any(layer != kv_layers[0] for layer in kv_layers):
        raise MlxformerError(f"{where}: the layers' cache settings differ")
    n = max(tokenizer.vocab_size, model.args.vocab_size)
    if not isinstance(token_ids, list) or not token_ids or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n for t in token_ids
    ):
        raise MlxformerError(f"{where}: 'token_ids' must be a non-empty list of token ids below {n}")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise MlxformerError(f"{where}: 'messages' must be a list of objects")
    return token_ids


def _count(arrays: dict[str, mx.array], layer: int) -> int:
    """How many arrays ``layer.{layer}.0``, ``.1``, ... the file holds."""
    count = 0
    while f"layer.{layer}.{count}" in arrays:
        count += 1
    return count


def _rebuild(name: str, meta: dict[str, str], state: list[mx.array]) -> Cache:
    """A cache of class ``name`` from fields and arrays ``file_checks`` has accepted."""
    cache: Cache = CACHE_CLASSES[name]()
    cache.meta_state = meta  # type: ignore[misc]
    cache.state = tuple(state)  # type: ignore[misc]
    return cache


def load_prompt_cache(
    path: str | Path, model: Model, tokenizer: Tokenizer, settings: CacheSettings | None = None
) -> tuple[list[Cache], list[int]]:
    """The saved cache and the token ids it holds (see ``load_prompt_cache_file``)."""
    loaded = load_prompt_cache_file(path, model, tokenizer, settings)
    return loaded.cache, loaded.token_ids


def strip_cached_prefix(ids: Sequence[int], cached_ids: Sequence[int]) -> list[int]:
    """The ids still to prefill: ``ids`` minus the cached prefix. A prompt that does not
    start with the cached ids is an error (appending it would put a second BOS or system
    header in mid-context)."""
    ids, cached_ids = list(ids), list(cached_ids)
    if ids[: len(cached_ids)] != cached_ids:
        n = next((i for i, (a, b) in enumerate(zip(ids, cached_ids)) if a != b), min(len(ids), len(cached_ids)))
        raise MlxformerError(
            f"the prompt does not extend the cached one (they differ at token {n} of the {len(cached_ids)} "
            "cached): use the same system message, template and prompt start as cache-prompt"
        )
    if len(ids) == len(cached_ids):
        raise MlxformerError("the prompt is entirely in the prompt cache; add text after the cached prompt")
    return ids[len(cached_ids):]


def cache_prompt(
    path: str | Path, model: Model, tokenizer: Tokenizer, token_ids: Sequence[int],
    settings: CacheSettings | None = None, *, overwrite: bool = False,
) -> list[Cache]:
    """Prefill ``token_ids`` into a new cache and save it to ``path``; returns the cache."""
    cache = make_cache(model, settings)
    prefill(model, mx.array(list(token_ids)), cache)
    mx.eval([c.state for c in cache])
    save_prompt_cache(path, cache, token_ids, model, tokenizer, overwrite=overwrite)
    return cache
