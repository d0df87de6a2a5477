"""Safetensors files and HF/MLX model dirs, checked before anything trusts them.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping tensor
names to ``dtype``/``shape``/``data_offsets``, then the raw data. Every entry's types, its
extent and the shard index's paths are checked here, with errors naming the file and the
tensor; the tensors themselves are then read lazily by ``mx.load``.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path, PurePosixPath
from typing import Any

import mlx.core as mx

from mlxformer.errors import MlxformerError
from mlxformer.formats.jsonio import read_json_object

# safetensors dtype name -> the MLX dtype it loads as (the FP8 types have none: refused).
DTYPES = {
    "F64": mx.float64, "F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16, "I64": mx.int64,
    "I32": mx.int32, "I16": mx.int16, "I8": mx.int8, "U64": mx.uint64, "U32": mx.uint32, "U16": mx.uint16,
    "U8": mx.uint8, "BOOL": mx.bool_,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024
INDEX_NAME = "model.safetensors.index.json"
# The weight files of a model dir, as mlx-lm reads them; the hub download fetches the same.
WEIGHT_GLOB = "model*.safetensors"


def read_safetensors_header(path: Path) -> tuple[dict[str, tuple[tuple[int, ...], mx.Dtype]], int]:
    """``({tensor: (shape, dtype)}, header bytes)`` of ``path``, every entry checked."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise MlxformerError(f"{path}: not a safetensors file (too short)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(size - 8, MAX_HEADER_BYTES):
                raise MlxformerError(f"{path}: truncated or not a safetensors file (header length {header_len})")
            raw = f.read(header_len)
    except OSError as exc:
        raise MlxformerError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise MlxformerError(f"{path}: corrupt safetensors header") from None
    if not isinstance(header, dict):
        raise MlxformerError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_size = size - 8 - header_len
    entries, extents = {}, []
    for name, info in header.items():
        shape, dtype, start, end = _check_entry(path, name, info, data_size)
        entries[name] = (shape, dtype)
        extents.append((start, end, name))
    previous_end, previous = 0, None
    for start, end, name in sorted(extents):
        if start < previous_end:
            raise MlxformerError(f"{path}: tensor {name!r} overlaps tensor {previous!r}")
        previous_end, previous = max(previous_end, end), name
    return entries, 8 + header_len


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_entry(path: Path, name: str, info: Any, data_size: int) -> tuple[tuple[int, ...], mx.Dtype, int, int]:
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise MlxformerError(f"{where}: header entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise MlxformerError(f"{where}: dtype is not a string: {str(dtype)[:40]}")
    if dtype not in DTYPES:
        raise MlxformerError(f"{where}: unsupported dtype {dtype[:20]}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise MlxformerError(f"{where}: shape is not a list of non-negative integers: {str(shape)[:40]}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise MlxformerError(f"{where}: data_offsets is not two integers: {str(offsets)[:40]}")
    start, end = offsets
    if not 0 <= start <= end:
        raise MlxformerError(f"{where}: data_offsets {offsets} are not an increasing pair")
    if end > data_size:
        raise MlxformerError(f"{where}: truncated file: the tensor ends past the end of the data")
    dtype_mx = DTYPES[dtype]
    if end - start != math.prod(shape) * dtype_mx.size:
        raise MlxformerError(f"{where}: has {end - start} bytes, its shape {shape} of {dtype} needs "
                             f"{math.prod(shape) * dtype_mx.size}")
    return tuple(shape), dtype_mx, start, end


def _shard_path(directory: Path, index: Path, name: Any, tensor: str) -> Path:
    """A shard named by the index, confined to ``directory``: a plain relative file name."""
    if not isinstance(name, str) or not name:
        raise MlxformerError(f"{index}: weight_map entry for {tensor!r} is not a file name")
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or Path(name).is_absolute() or "\\" in name or ".." in parts:
        raise MlxformerError(f"{index}: weight_map entry for {tensor!r} points outside the model dir: {name[:80]!r}")
    return directory / name


def weight_files(directory: Path) -> dict[Path, list[str] | None]:
    """The weight files of an HF/MLX dir: from the shard index when there is one (each file
    with the tensors the index places in it), else ``model*.safetensors`` (or a single
    ``*.safetensors``) with ``None`` (all of its tensors)."""
    index = directory / INDEX_NAME
    if index.exists():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise MlxformerError(f"{index}: no weight_map object")
        files: dict[Path, list[str] | None] = {}
        for tensor, name in weight_map.items():
            files.setdefault(_shard_path(directory, index, name, tensor), []).append(tensor)  # type: ignore[union-attr]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise MlxformerError(f"{directory}: shard {missing[0]} listed in the index is missing")
        return dict(sorted(files.items()))
    found = sorted(directory.glob(WEIGHT_GLOB)) or sorted(directory.glob("*.safetensors"))
    if len(found) > 1 and not found[0].name.startswith("model"):
        raise MlxformerError(f"{directory}: several *.safetensors files ({found[0].name}, {found[1].name}) and "
                             f"no {INDEX_NAME} or model*.safetensors: which are the weights?")
    if not found:
        pickles = [p.name for p in directory.glob("*.bin")] + [p.name for p in directory.glob("*.pt*")]
        if pickles:
            raise MlxformerError(f"{directory}: only pickle checkpoints ({pickles[0]}); they are never loaded, use safetensors")
        raise MlxformerError(f"{directory}: no *.safetensors weights found")
    return {f: None for f in found}


def read_config(directory: Path) -> dict[str, Any]:
    """``config.json`` of a model dir."""
    config_path = directory / "config.json"
    if not config_path.exists():
        raise MlxformerError(f"{directory}: no config.json (not an HF or MLX model dir)")
    return read_json_object(config_path)


def load_tensors(file: Path) -> dict[str, mx.array]:
    """Every tensor of a small safetensors file (an adapter's, a sentence-transformers module's),
    its header checked first and the tensors read now: lazy arrays are bound to the loading
    thread's stream, and the engine's thread evaluates them."""
    read_safetensors_header(file)  # checked before mx.load trusts it
    try:
        tensors = dict(mx.load(str(file)))
        mx.eval(tensors)
    except (RuntimeError, ValueError) as exc:
        raise MlxformerError(f"{file}: cannot read safetensors ({exc})") from None
    return tensors  # type: ignore[return-value]


class ShardReader:
    """Tensors of safetensors files one at a time, as lazy arrays (read when evaluated).

    One ``mx.load`` of the last file is kept; a returned array is removed from it, so this
    reader never holds an array its caller has evaluated (a dict of all loaded arrays would
    keep each tensor in memory from its first evaluation on: the whole model by the end)."""

    def __init__(self) -> None:
        self._file: Path | None = None
        self._arrays: dict[str, mx.array] = {}

    def __call__(self, file: Path, name: str) -> mx.array:
        if self._file != file or name not in self._arrays:
            try:
                self._arrays = mx.load(str(file))
            except (RuntimeError, ValueError) as exc:
                raise MlxformerError(f"{file}: cannot read safetensors ({exc})") from None
            self._file = file
        return self._arrays.pop(name)
