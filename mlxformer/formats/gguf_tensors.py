"""Read chosen tensors of a GGUF file, and only those bytes, into the arrays ``mx.load`` gives.

``mx.load`` reads a whole GGUF file at once; a pipeline rank needs only its own layers. Here
each tensor's byte range (from ``gguf_header``) is read with numpy and turned into the same
MLX arrays: float tensors as they are, Q4_0/Q4_1/Q8_0 blocks as affine triplets
(``weight`` packed into uint32, float16 ``scales`` and ``biases``, groups of 32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import mlx.core as mx
import numpy as np

from mlxformer.errors import MlxformerError
from mlxformer.formats.gguf_header import GGUFTensor

_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16}
_BLOCK_DTYPES = {
    "Q8_0": np.dtype([("d", "<f2"), ("qs", "i1", 32)]),
    "Q4_0": np.dtype([("d", "<f2"), ("qs", "u1", 16)]),
    "Q4_1": np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)]),
}


def _read_bytes(path: Path, tensor: GGUFTensor) -> np.ndarray:
    with open(path, "rb") as f:
        f.seek(tensor.offset)
        data = f.read(tensor.nbytes)
    if len(data) < tensor.nbytes:
        raise MlxformerError(f"{path}: truncated file: tensor {tensor.name!r} ends past the end of the data")
    return np.frombuffer(data, np.uint8)


def _quantized(tensor: GGUFTensor, data: np.ndarray) -> dict[str, mx.array]:
    """Blocks of 32 weights -> MLX affine ``weight``/``scales``/``biases`` with ``w = scale * q + bias``."""
    blocks = data.view(_BLOCK_DTYPES[tensor.type_name])  # (n_blocks,)
    scale = blocks["d"]
    if tensor.type_name == "Q8_0":
        q = (blocks["qs"].astype(np.int16) + 128).astype(np.uint8)  # (n_blocks, 32), unsigned
        bias = scale * np.float16(-128)
    else:
        low, high = blocks["qs"] & 0x0F, blocks["qs"] >> 4  # elements 0-15 and 16-31 of each block
        q = np.concatenate([low, high], axis=1)  # (n_blocks, 32)
        q = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)  # two 4-bit values per byte, first in the low bits
        bias = blocks["m"] if tensor.type_name == "Q4_1" else scale * np.float16(-8)
    rows = tensor.shape[0] if len(tensor.shape) > 1 else 1
    groups = (-1,) if len(tensor.shape) == 1 else (rows, -1)
    weight = np.ascontiguousarray(q).view(np.uint32).reshape(groups)  # (rows, cols * bits / 32)
    return {
        "weight": mx.array(weight),
        "scales": mx.array(np.ascontiguousarray(scale).reshape(groups)),
        "biases": mx.array(np.ascontiguousarray(bias, dtype=np.float16).reshape(groups)),
    }


def read_gguf_tensors(path: Path, tensors: Iterable[GGUFTensor]) -> dict[str, mx.array]:
    """The arrays of ``tensors`` keyed as ``mx.load`` keys them (``x.weight`` or ``x.scales``...)."""
    out: dict[str, mx.array] = {}
    for tensor in tensors:
        data = _read_bytes(path, tensor)
        if tensor.type_name in _FLOAT_DTYPES:
            out[tensor.name] = mx.array(data.view(_FLOAT_DTYPES[tensor.type_name]).reshape(tensor.shape))
        elif tensor.type_name == "BF16":
            out[tensor.name] = mx.array(data.view(np.uint16).reshape(tensor.shape)).view(mx.bfloat16)
        elif tensor.type_name in _BLOCK_DTYPES:
            stem = tensor.name.rsplit(".", 1)[0]
            out.update({f"{stem}.{key}": value for key, value in _quantized(tensor, data).items()})
        else:
            raise MlxformerError(f"{path}: tensor {tensor.name!r} has unsupported GGUF type {tensor.type_name}")
    return out
