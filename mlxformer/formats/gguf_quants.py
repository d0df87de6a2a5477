"""Decode GGUF quantized blocks (llama.cpp's layouts) with vectorised numpy.

Types whose blocks MLX's affine layout (``w = scale * q + bias`` per group of 32) holds
exactly are unpacked to integer codes plus one float32 scale and bias per 32 values:
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (one block = one group) and Q4_K, Q5_K (each super-block's
6-bit sub-scales resolve to ``d * sc`` and ``-dmin * m`` per 32 values). Those products
are exact in float32, and MLX evaluates ``scale * q + bias`` with one rounding, as gguf-py
does, so the values are bit-identical to ``gguf.quants.dequantize``.

Q2_K, Q3_K and Q6_K scale 16-value sub-blocks, finer than MLX's smallest group (32); they
are decoded to float32 values here and requantized by the caller (see ``gguf.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


QK_K = 256
EXACT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K")
FLOAT_DECODED_TYPES = ("Q2_K", "Q3_K", "Q6_K")
GROUP_SIZE = 32


@dataclass
class Codes:
    """Affine codes of a (rows, cols) matrix: ``w = scales * q + biases`` per group of 32."""

    packed: np.ndarray  # uint32 (rows, cols * bits // 32): MLX's packed layout
    scales: np.ndarray  # float32 (rows, cols // 32)
    biases: np.ndarray  # float32 (rows, cols // 32)
    bits: int

    def q(self) -> np.ndarray:
        """The integer codes, uint8 (rows, cols)."""
        rows = self.packed.shape[0]
        bits = np.unpackbits(self.packed.view(np.uint8), axis=-1, bitorder="little").reshape(rows, -1, self.bits)
        return (bits << np.arange(self.bits, dtype=np.uint8)).sum(axis=-1, dtype=np.uint8)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 field at byte ``start`` of each block, as float32 (n, 1)."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """Low nibbles then high nibbles of each ``chunk``-byte run: (n, m*chunk) -> (n, 2*m*chunk)."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, chunk) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & np.uint8(0x0F)).reshape(n, -1)


def _bits_of(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit j of the little-endian bitfield ``qh`` for j < count: (n, bytes) -> (n, count)."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    return bits[:, :count]


def _repack_nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """GGUF nibble runs (low nibbles = values [0, chunk), high = [chunk, 2*chunk)) to MLX's order
    (value 2i in the low nibble of byte i): (n, m*chunk) bytes -> (n, m*chunk) bytes."""
    n = qs.shape[0]
    runs = qs.reshape(n, -1, chunk)
    even, odd = runs[..., 0::2], runs[..., 1::2]
    low = (even & np.uint8(0x0F)) | (odd << np.uint8(4))
    high = (even >> np.uint8(4)) | (odd & np.uint8(0xF0))
    return np.concatenate([low, high], axis=-1).reshape(n, -1)


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    d = _f16(b, 0)
    return _repack_nibbles(b[:, 2:18], 16), d, -8 * d, 4


def _q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    return _repack_nibbles(b[:, 4:20], 16), _f16(b, 0), _f16(b, 2), 4


def _q5_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    d = _f16(b, 0)
    q = _nibbles(b[:, 6:22], 16) | (_bits_of(b[:, 2:6], 32) << np.uint8(4))
    return pack_bytes(q, 5), d, -16 * d, 5


def _q5_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    q = _nibbles(b[:, 8:24], 16) | (_bits_of(b[:, 4:8], 32) << np.uint8(4))
    return pack_bytes(q, 5), _f16(b, 0), _f16(b, 2), 5


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    d = _f16(b, 0)
    return b[:, 2:34] ^ np.uint8(0x80), d, -128 * d, 8  # int8 q -> q + 128


def k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: the 8 six-bit sub-block scales and mins packed in 12 bytes -> two (n, 8) arrays."""
    n = scales.shape[0]
    d, m, m_d = np.split(scales.reshape(n, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(n, 8), mn.reshape(n, 8)


def _k_affine(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sc, mn = k_scale_min(b[:, 4:16])
    return _f16(b, 0) * sc.astype(np.float32), -(_f16(b, 2) * mn.astype(np.float32))


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    scale, bias = _k_affine(b)
    return _repack_nibbles(b[:, 16:144], 32), scale, bias, 4


def _q5_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    scale, bias = _k_affine(b)
    n = b.shape[0]
    # qh: 32 bytes; bit i of byte j is the high bit of value j of sub-block i.
    qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = _nibbles(b[:, 48:176], 32) | ((qh & np.uint8(1)).reshape(n, QK_K) << np.uint8(4))
    return pack_bytes(q, 5), scale, bias, 5


_EXACT = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k}


def _q6_k_values(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = (ql & np.uint8(0x0F)).reshape(n, 8, 32) | ((qh & np.uint8(3)).reshape(n, 8, 32) << np.uint8(4))
    values = q.reshape(n, 16, 16).astype(np.float32)
    values -= 32  # in place: these temporaries are the size of the tensor
    values *= (_f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)).reshape(n, 16, 1)
    return values.reshape(n, QK_K)


def _q3_k_values(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    hmask, qs, packed = b[:, :32], b[:, 32:96], b[:, 96:108]
    low = (packed[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    high = (packed[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(n, 16)
    sc = ((low & np.uint8(0x0F)) | ((high & np.uint8(3)) << np.uint8(4))).astype(np.int8) - np.int8(32)
    dl = (_f16(b, 108) * sc.astype(np.float32)).reshape(n, 16, 1)
    ql = qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    ql = (ql & np.uint8(3)).reshape(n, 16, 16)
    qh = hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    qh = ((qh & np.uint8(1)) ^ np.uint8(1)).reshape(n, 16, 16)  # a clear bit subtracts 4
    q = (ql.astype(np.int8) - (qh << np.uint8(2)).astype(np.int8)).astype(np.float32)
    return (dl * q).reshape(n, QK_K)


def _q2_k_values(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    dl = (_f16(b, 80) * (scales & np.uint8(0x0F)).astype(np.float32)).reshape(n, 16, 1)
    ml = (_f16(b, 82) * (scales >> np.uint8(4)).astype(np.float32)).reshape(n, 16, 1)
    q = qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = (q & np.uint8(3)).reshape(n, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


_VALUES = {"Q6_K": _q6_k_values, "Q3_K": _q3_k_values, "Q2_K": _q2_k_values}
_BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
          "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


def _blocks(raw: np.ndarray, type_name: str, rows: int, cols: int) -> np.ndarray:
    values, nbytes = _BLOCK[type_name]
    return np.ascontiguousarray(raw).reshape(rows * cols // values, nbytes)


def decode_codes(raw: np.ndarray, type_name: str, rows: int, cols: int) -> Codes:
    """Affine codes of an exact type's (rows, cols) matrix from its raw block bytes."""
    packed, scale, bias, bits = _EXACT[type_name](_blocks(raw, type_name, rows, cols))
    groups = cols // GROUP_SIZE
    packed = np.ascontiguousarray(packed).reshape(rows, -1).view(np.uint32)
    return Codes(packed, scale.reshape(rows, groups), bias.reshape(rows, groups), bits)


def decode_mxfp4(raw: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """MXFP4 blocks (an E8M0 byte, then 16 bytes whose low nibbles are codes 0-15 and high
    nibbles codes 16-31) as MLX's ``mxfp4`` arrays: the same E2M1 codes repacked two a byte in
    order, viewed as uint32 ``(rows, cols / 8)``, and the exponents ``(rows, cols / 32)``.
    Integer moves only: the values are the file's, bit for bit."""
    blocks = raw.reshape(-1, 17)
    qs = blocks[:, 1:]
    codes = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)  # (blocks, 32) in order
    packed = (codes[:, 0::2] | (codes[:, 1::2] << np.uint8(4))).astype(np.uint8)
    return {"weight": np.ascontiguousarray(packed).reshape(rows, -1).view(np.uint32),
            "scales": np.ascontiguousarray(blocks[:, 0]).reshape(rows, cols // 32)}


def decode_values(raw: np.ndarray, type_name: str, rows: int, cols: int) -> np.ndarray:
    """Float32 values of a (rows, cols) matrix of any supported quantized type."""
    if type_name in _VALUES:
        return _VALUES[type_name](_blocks(raw, type_name, rows, cols)).reshape(rows, cols)
    codes = decode_codes(raw, type_name, rows, cols)
    q = codes.q().reshape(rows, -1, GROUP_SIZE).astype(np.float32)  # (rows, groups, 32)
    return (codes.scales[..., None] * q + codes.biases[..., None]).reshape(rows, cols)


def requantize(values: np.ndarray, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """Min-max affine MLX triplet (packed, scales, biases) of float32 (rows, cols) values,
    group 32: ``bias`` is each group's minimum, so every value is within half a step,
    ``(max - min) / (2**bits - 1) / 2``. Computed with MLX (numpy's short-axis reductions are slow)."""
    rows, cols = values.shape
    groups = mx.array(values).reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.min(axis=-1), groups.max(axis=-1)
    scales = (high - low) / (2**bits - 1)
    inverse = mx.where(scales > 0, 1 / mx.where(scales > 0, scales, 1), 0)
    q = mx.clip(mx.round((groups - low[..., None]) * inverse[..., None]), 0, 2**bits - 1).astype(mx.uint8)
    q = q.reshape(rows, cols)
    packed = q.view(mx.uint32) if bits == 8 else mx.array(pack_bytes(np.array(q), bits)).view(mx.uint32)
    return packed, scales, low


def pack_bytes(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes (n, m) as MLX packs them: a little-endian bit stream per row, (n, m * bits // 8) bytes.
    Eight codes fill exactly ``bits`` bytes, so each run of 8 is assembled in a uint64."""
    n, m = q.shape
    if bits == 5:  # the hot case (Q5_0/Q5_1/Q5_K): byte arithmetic only
        v = [q[:, i::8] for i in range(8)]  # each (n, m // 8)
        out = np.empty((n, m // 8, 5), dtype=np.uint8)
        out[..., 0] = v[0] | (v[1] << 5)
        out[..., 1] = (v[1] >> 3) | (v[2] << 2) | (v[3] << 7)
        out[..., 2] = (v[3] >> 1) | (v[4] << 4)
        out[..., 3] = (v[4] >> 4) | (v[5] << 1) | (v[6] << 6)
        out[..., 4] = (v[6] >> 2) | (v[7] << 3)
        return out.reshape(n, m // 8 * 5)
    runs = q.reshape(n, m // 8, 8).astype(np.uint64)
    word = np.zeros((n, m // 8), dtype=np.uint64)
    for i in range(8):
        word |= runs[..., i] << np.uint64(bits * i)
    return word.view(np.uint8).reshape(n, m // 8, 8)[..., :bits].reshape(n, m // 8 * bits)
