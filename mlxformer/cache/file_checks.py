"""Checks of a prompt cache file's layers before any cache is rebuilt from them.

A file's fingerprint says which model made it, but its arrays and string fields can still be
edited or truncated. Every field a cache class reads (``meta_state``) and every array it holds
(``state``) is checked here against the model's ``n_kv_heads``/``head_dim``/window, the cache
type and the cached token count, so a bad file fails on load with one line naming the file,
the layer and the key, never mid-generation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxformer.cache.codec import CENTER_BLOCK, KV_BITS, KV_GROUP_SIZES
from mlxformer.cache.rotating import time_spans
from mlxformer.cache.state import state_shapes
from mlxformer.errors import MlxformerError

# class name -> the meta_state keys it reads (all integers but "bits", which may be "")
META_KEYS = {
    "KVCache": ("bits", "group_size", "start", "quantized"),
    "RotatingKVCache": ("bits", "group_size", "start", "quantized", "max_size", "keep", "offset", "idx", "slack"),
    "StateCache": ("offset", "keep"),
}


class _Layer:
    """One layer's fields, parsed; ``fail`` raises the one-line error for this file and layer."""

    def __init__(self, path: Path, layer: int, name: str, meta: Any) -> None:
        self.where = f"prompt cache file {path}: layer {layer}"
        if not isinstance(meta, dict):
            self.fail("meta_state is not an object")
        self.ints: dict[str, int] = {}
        for key in META_KEYS[name]:
            value = meta.get(key)
            if key == "bits" and value == "":
                continue
            if not isinstance(value, str) or not value.isdigit():
                self.fail(f"{key}={value!r} is not a non-negative integer")
            self.ints[key] = int(value)
        self.bits = self.ints.get("bits")
        if self.bits is not None and self.bits not in KV_BITS:
            self.fail(f"bits={self.bits} (supported: {KV_BITS})")
        if name == "StateCache":
            return
        if self.ints["group_size"] not in KV_GROUP_SIZES:
            self.fail(f"group_size={self.ints['group_size']} (supported: {KV_GROUP_SIZES})")
        if self.ints["quantized"] not in (0, 1) or (self.ints["quantized"] and self.bits is None):
            self.fail(f"quantized={self.ints['quantized']} does not fit bits={self.bits}")

    def fail(self, message: str) -> None:
        raise MlxformerError(f"{self.where}: {message}")


def check_layer(
    path: Path, layer: int, name: str, meta: Any, arrays: list[mx.array], args: Any, n_tokens: int
) -> None:
    """Refuse a layer whose fields or arrays do not fit ``args`` (the model's ``ModelArgs``), its
    cache class ``name`` (a key of ``META_KEYS``: the caller has refused unknown classes) or the
    ``n_tokens`` cached token ids."""
    fields = _Layer(path, layer, name, meta)
    if name == "StateCache":
        _check_state(fields, arrays, args, n_tokens)
        return
    rotating = name == "RotatingKVCache"
    quantized = fields.ints["quantized"] == 1
    per_pack = 3 if quantized else 1
    expected = 2 * per_pack + int(quantized) + int(rotating)
    if len(arrays) != expected:
        fields.fail(f"{len(arrays)} arrays where a {name} of these settings holds {expected}")
    # tokens stored: every cached token, or one per ring slot (the positions array's length)
    stored = arrays[-1].shape[0] if rotating and arrays[-1].ndim == 1 else n_tokens
    blocks = (n_tokens - 1) // CENTER_BLOCK + 1  # key centers needed (one per block up to the last token)
    for j, (array, (shape, kind)) in enumerate(zip(arrays, _layouts(fields, args.cache_dims(layer), stored, quantized,
                                                                     rotating))):
        if not _fits(tuple(array.shape), shape, blocks):
            expected = tuple(f">={blocks}" if n is None else n for n in shape)
            fields.fail(f"array {j} has shape {tuple(array.shape)}, expected {expected} for this model")
        if not _is(array.dtype, kind):
            fields.fail(f"array {j} has dtype {array.dtype}, expected {kind}")
    window = args.layer_window(layer)  # Gemma 2-4's global layers have none
    if rotating:
        _check_ring(fields, arrays[-1], window, n_tokens)
    elif window is not None:
        fields.fail(f"a {name} for a model with a {window}-token sliding window")


def _check_state(fields: _Layer, arrays: list[mx.array], args: Any, n_tokens: int) -> None:
    """A recurrent layer's conv window ``(1, kernel - 1, conv_dim)`` and state ``(1, H, Dk, Dv)``."""
    if fields.ints["offset"] != n_tokens:
        fields.fail(f"offset={fields.ints['offset']} but the file lists {n_tokens} token ids")
    if len(arrays) != 2:
        fields.fail(f"{len(arrays)} arrays where a StateCache holds 2")
    for j, (array, shape) in enumerate(zip(arrays, state_shapes(args))):
        if tuple(array.shape) != shape or not _is(array.dtype, "float"):
            fields.fail(f"array {j} has shape {tuple(array.shape)} and dtype {array.dtype}, expected {shape}, float")


def _layouts(fields: _Layer, dims: tuple[int, int, int], stored: int, quantized: bool, rotating: bool):
    """(shape, dtype kind) of each array of the layer, in ``state`` order; ``dims``: the layer's
    ``ModelArgs.cache_dims`` (MLA: one rope key and one latent)."""
    n_kv, key_dim, value_dim = dims
    prefix = (1, n_kv, stored)
    if quantized:
        group, bits = fields.ints["group_size"], fields.bits
        assert bits is not None

        def pack(dim: int) -> list[tuple[tuple[int | None, ...], str]]:
            if dim % group:
                fields.fail(f"group_size={group} does not divide head_dim {dim}")
            return [(prefix + (dim * bits // 32,), "uint32"), (prefix + (dim // group,), "float"),
                    (prefix + (dim // group,), "float")]

        layout: list[tuple[tuple[int | None, ...], str]] = pack(key_dim) + pack(value_dim) + [
            ((1, n_kv, None, key_dim), "float")]
    else:
        layout = [(prefix + (key_dim,), "float"), (prefix + (value_dim,), "float")]
    if rotating:
        layout.append(((stored,), "int32"))  # the absolute position of each slot
    return layout


def _fits(shape: tuple[int, ...], expected: tuple[int | None, ...], blocks: int) -> bool:
    """``shape`` is ``expected``, where None stands for at least ``blocks``."""
    return len(shape) == len(expected) and all(n >= blocks if e is None else n == e for n, e in zip(shape, expected))


def _is(dtype: mx.Dtype, kind: str) -> bool:
    if kind == "float":
        return mx.issubdtype(dtype, mx.floating)
    return dtype == getattr(mx, kind)


def _check_ring(fields: _Layer, positions: mx.array, window: int | None, n_tokens: int) -> None:
    """The ring's fields against its slots: the positions, read in the time order ``idx`` gives,
    must be the sinks then every token of the window up to the last cached one."""
    ints = fields.ints
    max_size, keep, offset, idx, slack = ints["max_size"], ints["keep"], ints["offset"], ints["idx"], ints["slack"]
    if not 0 <= keep < max_size:
        fields.fail(f"keep={keep} does not fit max_size={max_size}")
    if window is not None and (max_size > window or (max_size == window and keep)):
        fields.fail(f"max_size={max_size}, keep={keep} does not fit the model's {window}-token sliding window")
    if offset != n_tokens:
        fields.fail(f"offset={offset} but the file lists {n_tokens} token ids")
    slots = [int(p) for p in positions.tolist()]
    size, capacity = len(slots), max_size + slack
    if size > capacity or size > offset:
        fields.fail(f"holds {size} slots, more than max_size + slack = {capacity} or offset={offset}")
    full = size == capacity
    if (full and not keep <= idx < capacity) or (not full and idx != size):
        fields.fail(f"idx={idx} does not fit {size} slots of {capacity}")
    ordered = [p for a, b in time_spans(size, capacity, keep, idx) for p in slots[a:b]]
    sinks = min(keep, size)
    needed = max(sinks, offset - (max_size - keep))  # the oldest token the next query sees
    tail = ordered[sinks:]
    if (
        ordered[:sinks] != list(range(sinks))
        or (tail and (tail != list(range(tail[0], offset)) or tail[0] > needed))
        or (not tail and offset > sinks)
    ):
        fields.fail("the slot positions do not fit idx, offset and max_size")
