"""How caches store keys/values: float, or packed with ``mx.quantize`` and attended without unpacking.

Stored tensors are "packs": a tuple of arrays whose axis 2 is the sequence axis, either
``(data,)`` for float storage or ``(weights, scales, biases)`` for quantized storage. The
helpers here slice, concatenate and write packs so the caches never look at their contents.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import mlx.core as mx
import numpy as np

from mlxformer.models.mask import Mask
from mlxformer.models.attention_ops import (fused_attention, mask_scores, softcap_scores, softcapped_attention,
                                            softmax_with_sinks)
from mlxformer.errors import MlxformerError

Pack = tuple[mx.array, ...]  # each (B, n_kv, S, ...), sequence on axis 2

KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)


# --- packs -----------------------------------------------------------------------------


def pack_slice(pack: Pack, start: int, stop: int) -> Pack:
    """Tokens ``start:stop`` of every array in ``pack``."""
    return tuple(x[..., start:stop, :] for x in pack)


def pack_concat(packs: list[Pack]) -> Pack:
    """Join packs along the sequence axis."""
    return tuple(mx.concatenate(parts, axis=2) for parts in zip(*packs))


def pack_write(buffer: Pack, start: int, pack: Pack) -> None:
    """Write ``pack`` into ``buffer`` in place at sequence position ``start``."""
    stop = start + pack[0].shape[2]
    for target, source in zip(buffer, pack):
        target[..., start:stop, :] = source


def pack_zeros_like(pack: Pack, length: int) -> Pack:
    """Zero buffers shaped like ``pack`` but ``length`` tokens long."""
    return tuple(mx.zeros((*x.shape[:2], length, x.shape[3]), x.dtype) for x in pack)


def pack_nbytes(pack: Pack | None) -> int:
    """Bytes held by a pack."""
    return sum(x.nbytes for x in pack) if pack is not None else 0


def codec_settings(meta: dict[str, str]) -> tuple[int | None, int, int, bool]:
    """``bits``, ``group_size``, ``start`` and whether the storage is quantized yet, from a growing
    or rotating cache's ``meta_state`` (or a pool row's layer's)."""
    bits = int(meta["bits"]) if meta["bits"] else None
    return bits, int(meta["group_size"]), int(meta["start"]), meta["quantized"] == "1"


def quantized_at(tokens: int, bits: int | None, start: int) -> bool:
    """Whether a cache holding ``tokens`` tokens stores them quantized: with ``bits``, once it
    holds more than ``quantized_kv_start`` (``start``); the one rule for own caches, pool rows
    and the KV budget."""
    return bits is not None and tokens > start


def check_kv_quantization(bits: int, group_size: int) -> None:
    """Raise on KV quantization settings the kernels do not support."""
    if bits not in KV_BITS:
        raise MlxformerError(f"kv bits must be one of {KV_BITS}, got {bits}")
    if group_size not in KV_GROUP_SIZES:
        raise MlxformerError(f"kv group size must be one of {KV_GROUP_SIZES}, got {group_size}")


# --- the rotation that spreads outlier channels before quantization ----------------------


def is_power_of_two(dim: int) -> bool:
    """Whether ``dim`` is a power of two (the head dims the fast Hadamard transform serves)."""
    return dim > 0 and dim & (dim - 1) == 0


@lru_cache(maxsize=None)
def _fallback_rotation(dim: int, dtype: mx.Dtype) -> mx.array:
    """A fixed random orthogonal ``(dim, dim)`` matrix for head dims that are not powers of two."""
    q, r = np.linalg.qr(np.random.default_rng(dim).standard_normal((dim, dim)))
    return mx.array((q * np.sign(np.diag(r))).astype(np.float32)).astype(dtype)


def rotate(x: mx.array, scale: float = 1.0) -> mx.array:
    """``scale * (x @ R)`` along the last axis, R a fixed orthogonal ``(D, D)`` matrix.

    R is the normalized Hadamard matrix when D is a power of two, applied by
    ``mx.hadamard_transform`` in O(D log D) (the extra ``scale`` is folded into its own
    normalization), else a fixed random orthogonal matrix. Keys and values are stored as
    ``x @ R``: attention is unchanged because ``(q R)(k R)^T = q k^T`` and
    ``softmax(.) (v R) R^T = softmax(.) v``, while a few large-magnitude channels (common in
    post-RoPE keys) are spread over the whole head, so each quantization group's range is
    set by typical values rather than by the outliers.
    """
    dim = x.shape[-1]
    if is_power_of_two(dim):
        return mx.hadamard_transform(x, scale=scale / dim**0.5)
    out = x @ _fallback_rotation(dim, x.dtype)
    return out * scale if scale != 1.0 else out


def unrotate(x: mx.array) -> mx.array:
    """``x @ R^T``: back from the rotated basis (the normalized Hadamard matrix is its own inverse)."""
    dim = x.shape[-1]
    if is_power_of_two(dim):
        return mx.hadamard_transform(x)
    return x @ _fallback_rotation(dim, x.dtype).T


# --- the codec: float or quantized storage, and attention over it -------------------------


CENTER_BLOCK = 128  # tokens per key center: keys at positions b*128 .. b*128+127 share center b
CENTER_MIN = 16  # a block's center is the mean of its first keys when at least this many come at once


def center_blocks(positions: Sequence[int]) -> list[int]:
    """The key-center block of each absolute position."""
    return [p // CENTER_BLOCK for p in positions]


@dataclass(frozen=True)
class KVCodec:
    """How one cache stores keys/values: ``bits=None`` is float, else ``mx.quantize``d.

    Quantized keys are stored centered, ``(k - c_b) @ R``, with one center ``c_b`` per block of
    ``CENTER_BLOCK`` positions: the mean of the block's keys when a chunk brings at least
    ``CENTER_MIN`` of them, else the previous block's center. Removing each channel's offset
    keeps it from widening every group's range; after RoPE a channel's offset turns with the
    position (slowly, for the long-wavelength channels that carry most of it), so one center
    fixed from the first chunk grows stale along the context. Attention adds ``q . c_b`` back
    to each key's score (``q . k = q . (k - c_b) + q . c_b``). The centers are saved with the cache.
    """

    bits: int | None = None
    group_size: int = 64
    key_center: mx.array | None = None  # (B, n_kv, n_blocks, D): block b's center

    def centered(self, key_center: mx.array | None) -> "KVCodec":
        """This storage with ``key_center`` as its centers."""
        return KVCodec(self.bits, self.group_size, key_center)

    def with_key_center(self, keys: mx.array, positions: Sequence[int]) -> "KVCodec":
        """This codec with centers for every block that ``keys`` (B, n_kv, L, D), at absolute
        ``positions`` (L,), reach; existing centers never change (stored keys depend on them)."""
        if self.bits is None:
            return self
        have = 0 if self.key_center is None else self.key_center.shape[2]
        members: dict[int, list[int]] = {}  # block -> the indices of its keys (one pass: long prompts)
        if isinstance(positions, range) and positions.step == 1:
            for block in range(positions.start // CENTER_BLOCK, (positions.stop - 1) // CENTER_BLOCK + 1):
                first = max(block * CENTER_BLOCK, positions.start) - positions.start
                members[block] = list(range(first, min((block + 1) * CENTER_BLOCK, positions.stop) - positions.start))
        else:
            for j, block in enumerate(center_blocks(positions)):
                members.setdefault(block, []).append(j)
        if max(members) < have:
            return self
        centers = [] if self.key_center is None else [self.key_center]
        previous = None if self.key_center is None else self.key_center[:, :, -1:]
        for block in range(have, max(members) + 1):
            mine = members.get(block, [])
            if mine and (len(mine) >= CENTER_MIN or previous is None):
                picked = keys[:, :, mine[0] : mine[-1] + 1] if mine[-1] - mine[0] + 1 == len(mine) else (
                    mx.take(keys, mx.array(mine), axis=2))
                previous = mx.mean(picked, axis=2, keepdims=True)  # (B, n_kv, 1, D)
            elif previous is None:  # a block before any key (deferred quantization): the first keys' mean
                previous = mx.mean(keys, axis=2, keepdims=True)
            centers.append(previous)
        return self.centered(mx.concatenate(centers, axis=2))

    def store(self, keys: mx.array, values: mx.array, positions: Sequence[int]) -> tuple["KVCodec", Pack, Pack]:
        """Float ``keys``/``values`` ``(B, n_kv, L, D)`` at ``positions`` as this codec stores
        them: the codec with the centers they reach (``with_key_center``), and their packs."""
        codec = self.with_key_center(keys, positions)
        return codec, codec.encode_keys(keys, center_blocks(positions)), codec.encode(values)

    def unpack(self, arrays: Sequence[mx.array]) -> tuple["KVCodec", Pack, Pack]:
        """A cache's ``state`` arrays (the keys' pack, the values' pack, then the key centers
        when this codec quantizes) split back into the codec holding those centers and the packs."""
        packs, codec = list(arrays), self
        if self.bits is not None:
            codec = self.centered(packs.pop())
        half = len(packs) // 2
        return codec, tuple(packs[:half]), tuple(packs[half:])

    def covering(self, n_blocks: int) -> "KVCodec":
        """This codec with at least ``n_blocks`` centers, new ones repeating the last (a batch of
        single-token decode steps)."""
        if self.key_center is None or self.key_center.shape[2] >= n_blocks:
            return self
        extra = mx.repeat(self.key_center[:, :, -1:], n_blocks - self.key_center.shape[2], axis=2)
        return self.centered(mx.concatenate([self.key_center, extra], axis=2))

    def encode(self, x: mx.array) -> Pack:
        """``(B, n_kv, L, D)`` values to a pack."""
        if self.bits is None:
            return (x,)
        if x.shape[-1] % self.group_size:
            raise MlxformerError(f"head_dim {x.shape[-1]} is not a multiple of the kv group size {self.group_size}")
        return tuple(mx.quantize(rotate(x), group_size=self.group_size, bits=self.bits))

    def encode_keys(self, keys: mx.array, blocks: Sequence[int] | mx.array) -> Pack:
        """``(B, n_kv, L, D)`` keys to a pack, centered when quantized (``with_key_center``
        first); ``blocks``: each key's center block, ``(L,)`` or per row ``(B, L)``."""
        if self.bits is None or self.key_center is None:
            return self.encode(keys)
        return self.encode(keys - self._centers_of(blocks).astype(keys.dtype))

    def _centers_of(self, blocks: Sequence[int] | mx.array) -> mx.array:
        """The center of each key: ``(B, n_kv, L, D)`` (or ``(B, n_kv, 1, D)`` when all share one)."""
        assert self.key_center is not None
        if not isinstance(blocks, mx.array):
            if len(set(blocks)) == 1:
                return self.key_center[:, :, blocks[0] : blocks[0] + 1]
            return mx.take(self.key_center, mx.array(list(blocks)), axis=2)
        B, n_kv, _, D = self.key_center.shape
        index = mx.broadcast_to(blocks[:, None, :, None], (B, n_kv, blocks.shape[-1], D))  # per row
        return mx.take_along_axis(self.key_center, index, axis=2)

    def decode(self, pack: Pack) -> mx.array:
        """A pack back to a float ``(B, n_kv, S, D)`` array (keys come back centered)."""
        if self.bits is None:
            return pack[0]
        return unrotate(mx.dequantize(*pack, group_size=self.group_size, bits=self.bits))

    @property
    def state(self) -> tuple[mx.array, ...]:
        """Arrays to save beside the packs (the key centers, once set)."""
        return () if self.key_center is None else (self.key_center,)

    def attention(
        self, queries: mx.array, keys: Pack, values: Pack, scale: float, mask: Mask, softcap: float | None = None,
        key_blocks: mx.array | None = None, sinks: mx.array | None = None,
    ) -> mx.array:
        """Attend ``(B, n_heads, L, D)`` queries over packed keys/values (scores soft-capped at
        ``softcap`` when set, per-head ``sinks`` in the softmax); ``key_blocks``: the center
        block of each key, ``(S,)`` or per row ``(B, S)`` (default: key ``s`` is at position ``s``).

        Quantized, the softmax attention runs directly on the packed keys/values, GQA heads
        unrepeated. The part the centered keys left out (``q . c_b``, ``center_scores``) is added
        to the scores first, so the scores are those of the keys themselves, which soft-capping
        (not shift-invariant) needs."""
        if self.bits is None:
            if softcap is not None:
                return softcapped_attention(queries, keys[0], values[0], scale, mask, softcap, sinks)
            return fused_attention(queries, keys[0], values[0], scale, mask, sinks)
        bias = self.center_scores(queries, keys[0].shape[2], key_blocks, scale)
        quantized = dict(group_size=self.group_size, bits=self.bits)
        B, n_heads, L, D = queries.shape
        n_kv = keys[0].shape[1]
        n_rep = n_heads // n_kv
        # The packs hold rotated keys/values (see ``rotate``): rotate the queries too, with the
        # attention scale folded into the transform's normalization.
        # (B, n_heads, L, D) -> (B, n_kv, n_rep, L, D): each K/V head serves n_rep query heads.
        queries = rotate(queries, scale).reshape(B, n_kv, n_rep, L, D)
        # (B, n_kv, S, ...) -> (B, n_kv, 1, S, ...): broadcast over the n_rep axis.
        keys = tuple(mx.expand_dims(x, 2) for x in keys)
        values = tuple(mx.expand_dims(x, 2) for x in values)
        scores = mx.quantized_matmul(queries, *keys, transpose=True, **quantized)  # (B, n_kv, n_rep, L, S)
        scores = scores.astype(mx.float32)
        if bias is not None:
            scores = scores + bias
        if softcap is not None:
            scores = softcap_scores(scores, softcap)
        scores = mask_scores(scores, mask)
        probs = softmax_with_sinks(scores, sinks).astype(queries.dtype)
        out = mx.quantized_matmul(probs, *values, transpose=False, **quantized)  # (B, n_kv, n_rep, L, D)
        out = unrotate(out)  # back from the rotated basis
        return out.reshape(B, n_heads, L, D)  # (B, n_kv, n_rep, L, D) -> (B, n_heads, L, D)

    def center_scores(self, queries: mx.array, n_keys: int, key_blocks: mx.array | None, scale: float) -> mx.array | None:
        """``scale * q . c_b`` for every query and each of ``n_keys`` keys, ``(B, n_kv, n_rep, L, S)``:
        what the centered keys leave out of the scores (None without centers); ``key_blocks`` as
        in ``attention``."""
        if self.key_center is None:
            return None
        if key_blocks is None:
            key_blocks = mx.arange(n_keys) // CENTER_BLOCK
        B, n_heads, L, D = queries.shape
        n_kv = self.key_center.shape[1]
        # (B, n_heads, L, D) -> (B, n_kv, n_rep, L, D); centers (B, n_kv, NB, D) -> (B, n_kv, 1, D, NB)
        q = queries.reshape(B, n_kv, n_heads // n_kv, L, D).astype(mx.float32)
        centers = mx.expand_dims(self.key_center.astype(mx.float32).swapaxes(-1, -2), 2)
        per_block = (q * scale) @ centers  # (B, n_kv, n_rep, L, NB)
        if key_blocks.ndim == 1:
            return mx.take(per_block, key_blocks, axis=-1)  # (B, n_kv, n_rep, L, S)
        index = mx.broadcast_to(key_blocks[:, None, None, None, :], (*per_block.shape[:-1], key_blocks.shape[-1]))
        return mx.take_along_axis(per_block, index, axis=-1)


FLOAT_CODEC = KVCodec()
