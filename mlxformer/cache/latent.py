"""Attention over multi-head latent attention's cache (DeepSeek-V2/V3, GLM-4.7-Flash).

An MLA layer caches, per token, one rope key ``(qk_rope_head_dim,)`` and one compressed latent
``(kv_lora_rank,)`` shared by every head, in an ordinary cache as single-head "keys" and
"values" (``(B, 1, S, rope)``, ``(B, 1, S, rank)``): the growing and rotating caches, the
quantized codec, the batched decode, the prefix and disk caches and the KV budget all hold it
unchanged. The queries come already absorbed into the latent space (``models.mla``), so
attention reads the latent as both the content key and the value and nothing is expanded:

    scores = scale * (q_latent . latent + q_rope . k_rope),   out = softmax(scores) @ latent

Quantized, both products run on the packed arrays (rotated queries against rotated storage;
the rope keys' centers added back as in ``codec.KVCodec.attention``).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from mlxformer.cache.codec import KVCodec, Pack, rotate, unrotate
from mlxformer.models.attention_ops import mask_scores
from mlxformer.models.mask import Mask

# MLA's expanded form (``MLAttention.expanded``): ``(q_nope, q_rope, k_rope, latent, mask)`` ->
# ``(B, H, L, v)``, the keys and values expanded from float latents ``(B, 1, S, rank)``
Expand = Callable[[mx.array, mx.array, mx.array, mx.array, Mask], mx.array]


def latent_attention(
    codec: KVCodec, q_latent: mx.array, q_rope: mx.array, keys: Pack, values: Pack, scale: float, mask: Mask,
    key_blocks: mx.array | None = None,
) -> mx.array:
    """``(B, H, L, rank)`` latent outputs for absorbed queries ``q_latent (B, H, L, rank)`` and
    ``q_rope (B, H, L, rope)`` over the rope-key pack ``keys`` and the latent pack ``values``
    (each ``(B, 1, S, ...)``); ``key_blocks`` as in ``KVCodec.attention``."""
    B, H, L, _ = q_latent.shape
    if codec.bits is None:
        latent, rope_keys = values[0], keys[0]
        scores = (q_latent @ latent.swapaxes(-1, -2)).astype(mx.float32)  # (B, H, L, S)
        scores = (scores + (q_rope @ rope_keys.swapaxes(-1, -2)).astype(mx.float32)) * scale
        probs = mx.softmax(mask_scores(scores, mask), axis=-1).astype(latent.dtype)
        return probs @ latent  # (B, H, L, rank)
    quantized = dict(group_size=codec.group_size, bits=codec.bits)
    scores = mx.quantized_matmul(rotate(q_latent, scale), *values, transpose=True, **quantized).astype(mx.float32)
    scores = scores + mx.quantized_matmul(rotate(q_rope, scale), *keys, transpose=True, **quantized).astype(mx.float32)
    bias = codec.center_scores(q_rope, keys[0].shape[2], key_blocks, scale)
    if bias is not None:  # the rope keys are stored centered: add q . c_b back
        scores = scores + bias.reshape(scores.shape)
    probs = mx.softmax(mask_scores(scores, mask), axis=-1).astype(q_latent.dtype)
    return unrotate(mx.quantized_matmul(probs, *values, transpose=False, **quantized))  # (B, H, L, rank)
