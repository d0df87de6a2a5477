"""Validate safetensors files before handing them to ``mx.load``.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping tensor
names to ``dtype``/``shape``/``data_offsets``, then the raw data. A truncated download or a
corrupt header is caught here with a message naming the file and the tensor.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxformer.errors import MlxformerError
from mlxformer.formats.jsonio import read_json_object

_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The parsed, validated header of ``path`` (without ``__metadata__``)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise MlxformerError(f"{path}: not a safetensors file (too short)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise MlxformerError(f"{path}: truncated or not a safetensors file (header length {header_len})")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise MlxformerError(f"{path}: corrupt safetensors header") from None
    if not isinstance(header, dict):
        raise MlxformerError(f"{path}: corrupt safetensors header")
    header.pop("__metadata__", None)
    data_size = size - 8 - header_len
    for name, info in header.items():
        _check_entry(path, name, info, data_size)
    return header


def _check_entry(path: Path, name: str, info: Any, data_size: int) -> None:
    try:
        dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise MlxformerError(f"{path}: corrupt header entry for tensor {name!r}") from None
    if dtype not in _DTYPE_BYTES:
        raise MlxformerError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
    if end > data_size:
        raise MlxformerError(f"{path}: truncated file: tensor {name!r} ends past the end of the data")
    if end - start != math.prod(shape) * _DTYPE_BYTES[dtype]:
        raise MlxformerError(f"{path}: tensor {name!r} has {end - start} bytes, its shape {shape} needs more")


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of an HF/MLX dir, from the shard index when there is one."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json_object(index).get("weight_map", {})
        files = sorted({directory / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise MlxformerError(f"{directory}: shard {missing[0]} listed in the index is missing")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in directory.glob("*.bin")] + [p.name for p in directory.glob("*.pt*")]
        if pickles:
            raise MlxformerError(f"{directory}: only pickle checkpoints ({pickles[0]}); they are never loaded, use safetensors")
        raise MlxformerError(f"{directory}: no *.safetensors weights found")
    return files


def read_config(directory: Path) -> dict[str, Any]:
    """``config.json`` of a model dir."""
    config_path = directory / "config.json"
    if not config_path.exists():
        raise MlxformerError(f"{directory}: no config.json (not an HF or MLX model dir)")
    return read_json_object(config_path)


def load_safetensors(files: list[Path]) -> dict[str, mx.array]:
    """All tensors of validated safetensors files, keyed by name."""
    weights: dict[str, mx.array] = {}
    for file in files:
        read_safetensors_header(file)
        try:
            weights.update(mx.load(str(file)))
        except (RuntimeError, ValueError) as exc:
            raise MlxformerError(f"{file}: cannot read safetensors ({exc})") from None
    return weights
