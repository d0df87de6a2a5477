"""Attention with Gemma 2's logit soft-capping, which the fused kernel cannot apply, and
gpt-oss's attention sinks (a learned per-head logit that joins each softmax) for the paths
that compute scores themselves."""

from __future__ import annotations

import mlx.core as mx

from mlxformer.models.mask import Mask


def softcap_scores(scores: mx.array, cap: float) -> mx.array:
    """``cap * tanh(scores / cap)``."""
    return mx.tanh(scores / cap) * cap


def mask_scores(scores: mx.array, mask: Mask) -> mx.array:
    """Apply a ``Mask`` to float32 scores ``(..., L, S)`` (keys aligned to the last queries)."""
    L, S = scores.shape[-2:]
    if isinstance(mask, str):  # "causal", aligned to the last keys
        mask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]  # (L, S)
    if mask is None:
        return scores
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.array(-mx.inf, mx.float32))
    return scores + mask.astype(mx.float32)


def softmax_with_sinks(scores: mx.array, sinks: mx.array | None) -> mx.array:
    """Softmax over the last axis of float32 scores ``(B, n_kv, n_rep, L, S)``; with per-head
    ``sinks`` ``(n_heads,)`` each row's softmax also counts ``exp(sink)``, whose share is dropped."""
    if sinks is None:
        return mx.softmax(scores, axis=-1)
    B, n_kv, n_rep, L, _ = scores.shape
    column = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, n_kv, n_rep, 1, 1), (B, n_kv, n_rep, L, 1))
    return mx.softmax(mx.concatenate([scores, column], axis=-1), axis=-1)[..., :-1]


def fused_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Mask, sinks: mx.array | None = None
) -> mx.array:
    """``mx.fast.scaled_dot_product_attention``, with ``sinks`` in the queries' dtype when given."""
    if sinks is None:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask,
                                                sinks=sinks.astype(queries.dtype))


def softcapped_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Mask, softcap: float | None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Softmax attention of ``(B, n_heads, L, D)`` queries over ``(B, n_kv, S, D)`` keys/values
    with soft-capped scores (when ``softcap`` is set) and ``sinks``; GQA heads unrepeated."""
    B, n_heads, L, D = queries.shape
    n_kv = keys.shape[1]
    # (B, n_heads, L, D) -> (B, n_kv, n_rep, L, D): each K/V head serves n_rep query heads.
    q = (queries * scale).reshape(B, n_kv, n_heads // n_kv, L, D)
    scores = (q @ mx.expand_dims(keys, 2).swapaxes(-1, -2)).astype(mx.float32)  # (B, n_kv, n_rep, L, S)
    if softcap is not None:
        scores = softcap_scores(scores, softcap)
    weights = softmax_with_sinks(mask_scores(scores, mask), sinks).astype(values.dtype)
    out = weights @ mx.expand_dims(values, 2)  # (B, n_kv, n_rep, L, D)
    return out.reshape(B, n_heads, L, D)


def position_query_scale(offset: int | mx.array, length: int, beta: float, period: int) -> mx.array:
    """Llama 4's (Ministral 3's) query scale ``1 + beta * log(1 + floor(p / period))`` for the
    positions ``offset..offset+length-1``; ``offset`` an int or a ``(B,)`` array. Shape
    ``(1 or B, 1, length, 1)``, to multiply ``(B, heads, length, head_dim)`` queries."""
    positions = mx.arange(length)[None] + (offset[:, None] if isinstance(offset, mx.array) else offset)  # (1|B, L)
    scale = 1 + beta * mx.log(1 + mx.floor(positions.astype(mx.float32) / period))
    return scale[:, None, :, None]
