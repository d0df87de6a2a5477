"""A strict GGUF container reader: header, metadata and a memory map of each tensor's bytes.

Every count, length and offset in the header is checked against the file size before
anything is allocated or looped over, so a hostile or broken file gives a one-line
``MlxformerError`` (never a huge allocation, a hang or a crash). Tensor bytes are not
read here: each tensor is a view into one read-only ``np.memmap`` of the file.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlxformer.errors import MlxformerError

# ggml type id -> (name, values per block, bytes per block), as in ggml.h / gguf-py.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 40
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: numpy-order ``shape`` (rows first), ggml type and its bytes."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    offset: int  # absolute, in the file
    nbytes: int


@dataclass
class GGUFFile:
    """A parsed GGUF file: metadata (Python/numpy values), tensors in file order, the file map."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data: np.memmap | np.ndarray
    header_bytes: int  # where the tensor data starts
    file_map: mmap.mmap | None = None

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the map."""
        return self.data[info.offset : info.offset + info.nbytes]

    def release(self, info: TensorInfo, start: int = 0, end: int | None = None) -> None:
        """Drop bytes ``start:end`` of the tensor's data (default: all) from this process's
        memory; they are re-read from the file if touched again. A decoded tensor then no
        longer counts twice, as file pages and as arrays."""
        if self.file_map is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        first = (info.offset + start) // mmap.PAGESIZE * mmap.PAGESIZE
        last = info.offset + (info.nbytes if end is None else end)
        self.file_map.madvise(mmap.MADV_DONTNEED, first, last - first)


class _Cursor:
    """Bounded little-endian reads from a buffer; running past the end raises ``EOFError``."""

    def __init__(self, buf: Any, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def remaining(self) -> int:
        return self.size - self.pos

    def scalar(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        if self.pos + n > self.size:
            raise EOFError
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        if length > self.remaining():
            raise EOFError
        data = self.buf[self.pos : self.pos + length]
        self.pos += length
        return bytes(data).decode("utf-8")

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row (the tokenizer's vocabulary: a hot loop, kept inline)."""
        buf, pos, size, out = self.buf, self.pos, self.size, []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > size:
                raise EOFError
            length = unpack(buf, pos)[0]
            pos += 8
            if length > size - pos:
                raise EOFError
            out.append(buf[pos : pos + length].decode("utf-8"))
            pos += length
        self.pos = pos
        return out

    def value(self, value_type: int, depth: int = 0) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            return self.array(depth)
        if value_type not in _SCALARS:
            raise ValueError(f"unknown metadata value type {value_type}")
        value = self.scalar(_SCALARS[value_type])
        if value_type == 7:
            return bool(value)
        if value_type == 6:  # shortest decimal that round-trips float32, e.g. 1e-05 not 9.9999997e-06
            return float(str(np.float32(value)))
        return value

    def array(self, depth: int) -> Any:
        item_type, count = self.scalar("<I"), self.scalar("<Q")
        if depth > 0:
            raise ValueError("nested metadata arrays are not supported")
        if item_type in _NUMPY:
            itemsize = np.dtype(_NUMPY[item_type]).itemsize
            if count * itemsize > self.remaining():
                raise EOFError
            values = np.frombuffer(self.buf, dtype=_NUMPY[item_type], count=count, offset=self.pos).copy()
            self.pos += count * itemsize
            return values.astype(bool) if item_type == 7 else values
        if item_type == _STRING:
            if count * 8 > self.remaining():  # each string takes at least its 8-byte length
                raise EOFError
            return self.strings(count)
        if item_type == _ARRAY:
            raise ValueError("nested metadata arrays are not supported")
        raise ValueError(f"unknown metadata array item type {item_type}")


def read_gguf(path: Path) -> GGUFFile:
    """Parse ``path``'s header and map its tensor data; any inconsistency raises ``MlxformerError``."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(4)
            if head != b"GGUF":
                raise MlxformerError(f"{path}: not a GGUF file (bad magic)")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise MlxformerError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        metadata, infos, data_start, alignment = _parse_header(path, _Cursor(buf, size))
    except (EOFError, struct.error):
        raise MlxformerError(f"{path}: truncated or corrupt GGUF header") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise MlxformerError(f"{path}: corrupt GGUF header ({str(exc).splitlines()[0][:200]})") from None
    tensors = _place_tensors(path, infos, data_start, alignment, size)
    data = np.frombuffer(buf, dtype=np.uint8)
    return GGUFFile(path, metadata, tensors, data, data_start, buf)


def _parse_header(path: Path, cur: _Cursor) -> tuple[dict[str, Any], list[tuple], int, int]:
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise MlxformerError(f"{path}: unsupported GGUF version {version}")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    # Smallest encodings: a key/value pair 8+4+1 bytes, a tensor entry 8+4+8+4+8 bytes.
    if n_kv * 13 > cur.remaining() or n_tensors * 32 > cur.remaining():
        raise MlxformerError(f"{path}: truncated or corrupt GGUF header (claims {n_tensors} tensors and {n_kv} metadata "
                             f"entries, more than the file can hold)")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        if key in metadata:
            raise MlxformerError(f"{path}: corrupt GGUF header (duplicate metadata key {key!r})")
        metadata[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise MlxformerError(f"{path}: tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        dims = [cur.scalar("<Q") for _ in range(n_dims)]
        infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise MlxformerError(f"{path}: general.alignment {alignment!r} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    return metadata, infos, data_start, alignment


def _place_tensors(
    path: Path, infos: list[tuple], data_start: int, alignment: int, size: int
) -> dict[str, TensorInfo]:
    """Check each tensor's type, shape, alignment and extent; no two may overlap."""
    tensors: dict[str, TensorInfo] = {}
    for name, dims, type_id, offset in infos:
        if name in tensors:
            raise MlxformerError(f"{path}: duplicate tensor name {name!r}")
        if type_id not in GGML_TYPES:
            raise MlxformerError(f"{path}: tensor {name!r} has unknown GGUF type id {type_id}")
        type_name, block, block_bytes = GGML_TYPES[type_id]
        count = 1
        for d in dims:
            if d == 0 or d > MAX_ELEMENTS:
                raise MlxformerError(f"{path}: tensor {name!r} has invalid dimension {d}")
            count *= d
            if count > MAX_ELEMENTS:
                raise MlxformerError(f"{path}: tensor {name!r} is absurdly large ({dims})")
        if dims[0] % block:
            raise MlxformerError(f"{path}: tensor {name!r} of type {type_name} has rows of {dims[0]} values, "
                                 f"not a multiple of its block size {block}")
        nbytes = count // block * block_bytes
        start = data_start + offset
        if offset % alignment:
            raise MlxformerError(f"{path}: tensor {name!r} data offset {offset} is not aligned to {alignment} bytes")
        tensors[name] = TensorInfo(name, tuple(reversed(dims)), type_name, start, nbytes)
        if start + nbytes > size:
            raise MlxformerError(f"{path}: tensor {name!r} extends past the end of the file "
                                 f"(truncated or corrupt GGUF)")
    end = data_start
    for info in sorted(tensors.values(), key=lambda t: t.offset):
        if info.offset < end:
            raise MlxformerError(f"{path}: tensor {info.name!r} overlaps another tensor's data")
        end = info.offset + info.nbytes
    return tensors
