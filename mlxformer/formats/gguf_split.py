"""Split GGUFs (llama.cpp's ``gguf-split``: ``NAME-00001-of-00003.gguf`` ...) read as one file.

The first part holds the model's metadata; every part holds ``split.no`` (0-based),
``split.count`` and ``split.tensors.count`` (the total), and its own tensors. ``read_any_gguf``
opens a plain GGUF as ``read_gguf`` does, and a split one (given any of its parts) as a
``SplitGGUF``: the first part's metadata, every part's tensors, each read from its own part.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mlxformer.errors import MlxformerError
from mlxformer.formats.gguf_reader import GGUFFile, TensorInfo, read_gguf

SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
MAX_SPLITS = 9999


def split_part_names(name: str) -> list[str] | None:
    """Every part's file name of the split GGUF ``name`` is a part of, or None if it is no part."""
    match = SPLIT_NAME.match(name)
    if match is None:
        return None
    count = int(match["count"])
    return [f"{match['stem']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


@dataclass
class SplitGGUF(GGUFFile):
    """Several parts as one ``GGUFFile``: ``tensors`` are all the parts', ``raw``/``release``
    go to the part that holds the tensor."""

    parts: list[GGUFFile] = field(default_factory=list)
    holder: dict[str, GGUFFile] = field(default_factory=dict)  # tensor name -> its part

    def raw(self, info: TensorInfo) -> np.ndarray:
        return self.holder[info.name].raw(info)

    def release(self, info: TensorInfo, start: int = 0, end: int | None = None) -> None:
        self.holder[info.name].release(info, start, end)


def _int_key(part: GGUFFile, key: str) -> int:
    value = part.metadata.get(key)
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 0 <= int(value) <= 1 << 40:
        raise MlxformerError(f"{part.path}: split GGUF metadata {key} is missing or not a count: {str(value)[:40]}")
    return int(value)


def read_any_gguf(path: Path) -> GGUFFile:
    """``path`` parsed: a plain GGUF as is; a split one (``path`` any of its parts) as one
    ``SplitGGUF``, after checking that every part is there, numbered in order, and that the
    tensors add up to ``split.tensors.count`` with no name twice."""
    path = Path(path)
    first = read_gguf(path)
    if SPLIT_COUNT not in first.metadata:
        return first
    count = _int_key(first, SPLIT_COUNT)
    names = split_part_names(path.name)
    if count <= 1 and names is None:
        return first
    if not 1 <= count <= MAX_SPLITS or names is None or len(names) != count:
        raise MlxformerError(f"{path}: a split GGUF part ({count} parts) must be named NAME-0000i-of-{count:05d}.gguf")
    missing = [name for name in names if not path.with_name(name).is_file()]
    if missing:
        raise MlxformerError(f"{path}: split GGUF part {missing[0]} is missing")
    parts = [first if name == path.name else read_gguf(path.with_name(name)) for name in names]
    holder: dict[str, GGUFFile] = {}
    tensors: dict[str, TensorInfo] = {}
    for number, part in enumerate(parts):
        if _int_key(part, SPLIT_NO) != number or _int_key(part, SPLIT_COUNT) != count:
            raise MlxformerError(f"{part.path}: split.no/split.count say part {part.metadata.get(SPLIT_NO)} of "
                                 f"{part.metadata.get(SPLIT_COUNT)}, its name part {number} of {count} (0-based)")
        for name, info in part.tensors.items():
            if name in tensors:
                raise MlxformerError(f"{part.path}: tensor {name!r} is also in {holder[name].path.name}")
            tensors[name], holder[name] = info, part
    total = _int_key(parts[0], SPLIT_TENSORS)
    if total != len(tensors):
        raise MlxformerError(f"{parts[0].path}: split.tensors.count is {total}, the parts hold {len(tensors)} tensors")
    head = parts[0]
    return SplitGGUF(head.path, head.metadata, tensors, head.data, sum(p.header_bytes for p in parts), head.file_map,
                     parts, holder)
