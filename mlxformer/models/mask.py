"""The attention mask type and the causal / sliding-window mask."""

from __future__ import annotations

from typing import Literal, Union

import mlx.core as mx

# The attention mask handed to ``mx.fast.scaled_dot_product_attention``: ``None`` lets every
# query see every key, ``"causal"`` is the lower-right aligned causal mask, an array is explicit.
Mask = Union[None, Literal["causal"], mx.array]


def causal_mask_for(query_len: int, key_len: int, window: int | None = None) -> Mask:
    """The mask for ``query_len`` new queries over ``key_len`` keys, the queries being the last ones.

    With a sliding ``window``, query at position p sees keys in ``(p - window, p]``.
    """
    if window is None or key_len <= window:
        return "causal" if query_len > 1 else None
    query_pos = mx.arange(key_len - query_len, key_len)[:, None]  # (L, 1)
    key_pos = mx.arange(key_len)[None]  # (1, S)
    return (key_pos <= query_pos) & (key_pos > query_pos - window)


def padded_mask(valid: mx.array, window: int | None = None, bidirectional: bool = False) -> mx.array:
    """The mask ``(B, 1, T, T)`` of a batch of sequences padded to ``T``: query i of row b sees
    key j when ``valid[b, j]`` (a real token, ``valid`` ``(B, T)`` bool) and j <= i, or any j
    when ``bidirectional``; with a sliding ``window``, ``i - window < j`` (bidirectional:
    ``|i - j| <= window // 2``, as transformers' EmbeddingGemma halves its window)."""
    T = valid.shape[1]
    query_pos = mx.arange(T)[:, None]  # (T, 1)
    key_pos = mx.arange(T)[None]  # (1, T)
    if bidirectional:
        seen = mx.ones((T, T), dtype=mx.bool_) if window is None else mx.abs(query_pos - key_pos) <= window // 2
    else:
        seen = key_pos <= query_pos if window is None else (key_pos <= query_pos) & (key_pos > query_pos - window)
    return seen[None, None] & valid[:, None, None, :]


def kept_rows(x: mx.array, keep: mx.array | None) -> mx.array:
    """The rows ``keep`` (positions, ``(K,)``) of ``x (B, T, ...)`` as ``(B, K, ...)``: the only
    ones a forward's caller reads (None: all of them)."""
    return x if keep is None else x[:, keep]
