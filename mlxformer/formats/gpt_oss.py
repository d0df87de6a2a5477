"""gpt-oss's expert tensors as HF stores them, mapped onto the decoder's (mlx-lm's) names.

transformers keeps each layer's experts fused: ``mlp.experts.gate_up_proj`` ``(E, hidden,
2 * inter)`` with gate on the even and up on the odd columns, ``down_proj`` ``(E, inter,
hidden)``, and their ``_bias``es. The hub's MXFP4 checkpoints store the matrices as
``*_blocks`` ``(E, out, groups, 16)`` uint8 (two E2M1 codes a byte, low nibble first) and
``*_scales`` ``(E, out, groups)`` uint8 (E8M0 exponents): byte for byte MLX's own ``mxfp4``
layout (eight codes a uint32, lowest bits first; the same exponents), so they are viewed,
never dequantized. The decoder's ``mlp.experts.{gate,up,down}_proj.{weight,bias,scales}``
are derived lazily from these (``Tensors.derived``, by ``weight_map``).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

import mlx.core as mx

from mlxformer.errors import MlxformerError
from mlxformer.formats.tensors import Derivation

_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
# The quantization HF's ``quant_method: mxfp4`` stands for, as MLX names it.
MXFP4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}


def _columns(parity: int | None, transpose: bool) -> Callable[[mx.array], mx.array]:
    """Even/odd output columns (``None``: all) of a fused tensor, optionally as ``(E, out, in)``."""

    def make(a: mx.array) -> mx.array:
        if parity is not None:
            a = a[..., parity::2]
        return mx.contiguous(a.swapaxes(-1, -2) if transpose else a)

    return make


def _rows(parity: int | None, packed: bool) -> Callable[[mx.array], mx.array]:
    """Even/odd output rows (``None``: all) of ``_blocks``/``_scales``; blocks viewed as uint32 words."""

    def make(a: mx.array) -> mx.array:
        if parity is not None:
            a = a[:, parity::2]
        if packed:  # (E, out, groups, 16) bytes -> (E, out, groups * 4) words
            a = mx.contiguous(a).reshape(*a.shape[:2], -1).view(mx.uint32)
        return mx.contiguous(a)

    return make


def _halve(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return tuple(n // 2 if i == axis % len(shape) else n for i, n in enumerate(shape))


def fused_expert_derivations(entries: Mapping[str, Any]) -> dict[str, Derivation]:
    """For each fused expert tensor among ``entries`` (name -> anything with ``shape``/``dtype``),
    the decoder tensors it becomes; empty for every other checkpoint."""
    out: dict[str, Derivation] = {}
    for name, entry in entries.items():
        match = _FUSED.match(name)
        if match is None:
            continue
        prefix, matrix, suffix = match.groups()
        shape, dtype = tuple(entry.shape), entry.dtype
        if matrix == "gate_up_proj" and shape[1 if suffix in ("_blocks", "_scales") else -1] % 2:
            raise MlxformerError(f"{name}: gate_up_proj needs an even number of columns, has shape {list(shape)}")
        targets = [("gate_proj", 0), ("up_proj", 1)] if matrix == "gate_up_proj" else [("down_proj", None)]
        for target, parity in targets:
            if suffix is None:  # (E, in, out) -> (E, out, in)
                kind, new_shape = "weight", (shape[0], shape[2] // (2 if parity is not None else 1), shape[1])
                make, new_dtype = _columns(parity, True), dtype
            elif suffix == "_bias":
                kind, new_shape = "bias", _halve(shape, -1) if parity is not None else shape
                make, new_dtype = _columns(parity, False), dtype
            elif suffix == "_blocks":
                if len(shape) != 4 or shape[3] != 16 or dtype != mx.uint8:
                    raise MlxformerError(f"{name}: MXFP4 blocks must be uint8 (experts, out, groups, 16), "
                                         f"not {dtype} {list(shape)}")
                rows = shape[1] // 2 if parity is not None else shape[1]
                kind, new_shape, new_dtype = "weight", (shape[0], rows, shape[2] * 4), mx.uint32
                make = _rows(parity, True)
            else:
                kind, new_shape = "scales", _halve(shape, 1) if parity is not None else shape
                make, new_dtype = _rows(parity, False), dtype
            out[f"{prefix}.{target}.{kind}"] = Derivation((name,), new_shape, new_dtype,
                                                           lambda arrays, make=make: make(arrays[0]))
    return out
