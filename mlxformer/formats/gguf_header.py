"""The header of a GGUF file, read without touching the tensor data: metadata and, for every
tensor, its name, HF-order shape, ggml type and byte range.

A thin view of ``gguf_reader`` (the one strict parser of the container), for callers that
only size things: long metadata arrays (the vocabulary) are given as ``[None] * length``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlxformer.formats.gguf_reader import GGML_TYPES, read_gguf

GGML_TYPE_NAMES = {type_id: name for type_id, (name, _, _) in GGML_TYPES.items()}
# (bytes per block, weights per block) of every ggml type.
BLOCK_LAYOUT = {name: (block_bytes, block) for name, block, block_bytes in GGML_TYPES.values()}
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
        """Bytes of the data as stored."""
        block_bytes, block_weights = BLOCK_LAYOUT.get(self.type_name, (0, 1))
        return self.size // block_weights * block_bytes


@dataclass(frozen=True)
class GGUFHeader:
    """Metadata (long arrays as ``[None] * length``) and tensor entries of a GGUF file."""

    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


def _summary(value: Any) -> Any:
    if isinstance(value, (list, np.ndarray)):
        return [None] * len(value) if len(value) > _MAX_KEPT_ARRAY else list(np.asarray(value).tolist())
    return value


def read_gguf_header(path: Path) -> GGUFHeader:
    """The metadata and tensor entries of ``path``; raises ``MlxformerError`` on a bad header."""
    gguf = read_gguf(path)
    metadata = {key: _summary(value) for key, value in gguf.metadata.items()}
    tensors = [GGUFTensor(t.name, t.shape, t.type_name, t.offset) for t in gguf.tensors.values()]
    return GGUFHeader(metadata, tensors)
