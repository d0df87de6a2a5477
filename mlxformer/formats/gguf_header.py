"""The header of a GGUF file, read without touching the tensor data: metadata and, for every
tensor, its name, HF-order shape, ggml type and byte range.

A GGUF file is a magic, a version, counts, the metadata key/value pairs, the tensor infos
(name, dims innermost-first, type, offset) and then the aligned data section.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from mlxformer.errors import MlxformerError

GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
    24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16",
}
# (bytes per block, weights per block) of the types this package reads.
BLOCK_LAYOUT = {"F32": (4, 1), "F16": (2, 1), "BF16": (2, 1), "Q4_0": (18, 32), "Q4_1": (20, 32), "Q8_0": (34, 32)}

_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_FLOAT32 = 6
_STRING = 8
_ARRAY = 9
# Arrays longer than this (the vocabulary) are recorded by length only.
_MAX_KEPT_ARRAY = 1024


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's header entry; ``shape`` is in HF (outermost-first) order."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    offset: int  # absolute byte offset of the data in the file

    @property
    def size(self) -> int:
        """Number of (logical) weights."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """Bytes of the data as stored (0 for an unsupported type)."""
        block_bytes, block_weights = BLOCK_LAYOUT.get(self.type_name, (0, 1))
        return self.size // block_weights * block_bytes


@dataclass(frozen=True)
class GGUFHeader:
    """Metadata (long arrays as ``[None] * length``) and tensor entries of a GGUF file."""

    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) < size:
        raise EOFError
    return struct.unpack(fmt, data)[0]


def _read_string(f: BinaryIO) -> str:
    length = _read(f, "<Q")
    data = f.read(length)
    if len(data) < length:
        raise EOFError
    return data.decode("utf-8")


def _read_value(f: BinaryIO, value_type: int) -> Any:
    if value_type == _STRING:
        return _read_string(f)
    if value_type == _ARRAY:
        item_type, count = _read(f, "<I"), _read(f, "<Q")
        if count > _MAX_KEPT_ARRAY:
            _skip_items(f, item_type, count)
            return [None] * count
        return [_read_value(f, item_type) for _ in range(count)]
    if value_type not in _SCALAR_FORMATS:
        raise ValueError(f"unknown metadata value type {value_type}")
    value = _read(f, _SCALAR_FORMATS[value_type])
    if value_type == _FLOAT32:  # shortest decimal that round-trips, e.g. 1e-05 not 9.9999997e-06
        return float(str(np.float32(value)))
    return value


def _skip_items(f: BinaryIO, item_type: int, count: int) -> None:
    if item_type in _SCALAR_FORMATS:
        f.seek(count * struct.calcsize(_SCALAR_FORMATS[item_type]), 1)
    elif item_type == _STRING:
        for _ in range(count):
            f.seek(_read(f, "<Q"), 1)
    else:
        for _ in range(count):
            _read_value(f, item_type)


def read_gguf_header(path: Path) -> GGUFHeader:
    """The metadata and tensor entries of ``path``; raises on a bad header."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise MlxformerError(f"{path}: not a GGUF file (bad magic)")
            version = _read(f, "<I")
            if version not in (2, 3):
                raise MlxformerError(f"{path}: unsupported GGUF version {version}")
            n_tensors, n_kv = _read(f, "<Q"), _read(f, "<Q")
            metadata = {}
            for _ in range(n_kv):
                key = _read_string(f)
                metadata[key] = _read_value(f, _read(f, "<I"))
            entries = []
            for _ in range(n_tensors):
                name = _read_string(f)
                dims = [_read(f, "<Q") for _ in range(_read(f, "<I"))]
                type_id, offset = _read(f, "<I"), _read(f, "<Q")
                entries.append((name, tuple(reversed(dims)), GGML_TYPE_NAMES.get(type_id, f"type {type_id}"), offset))
            alignment = int(metadata.get("general.alignment", 32))
            data_start = -(-f.tell() // alignment) * alignment
    except (EOFError, ValueError, UnicodeDecodeError):
        raise MlxformerError(f"{path}: truncated or corrupt GGUF header") from None
    tensors = [GGUFTensor(name, shape, type_name, data_start + offset) for name, shape, type_name, offset in entries]
    return GGUFHeader(metadata, tensors)
