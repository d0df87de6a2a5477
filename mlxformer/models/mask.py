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


def kept_rows(x: mx.array, keep: mx.array | None) -> mx.array:
    """The rows ``keep`` (positions, ``(K,)``) of ``x (B, T, ...)`` as ``(B, K, ...)``: the only
    ones a forward's caller reads (None: all of them)."""
    return x if keep is None else x[:, keep]
