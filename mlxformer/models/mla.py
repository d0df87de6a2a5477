"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash ``glm4_moe_lite``), in absorbed form.

Keys and values come from one compressed latent per token, ``kv_a_layernorm`` of the first
``kv_lora_rank`` features of ``kv_a_proj_with_mqa``, plus one rotated key of
``qk_rope_head_dim`` shared by every head. ``kv_b_proj`` would expand the latent into each
head's ``qk_nope_head_dim`` key features and ``v_head_dim`` values; instead its key part is
folded into the queries (``q_nope @ W_k``: ``(H, nope) -> (H, rank)``) and its value part
applied to the attention output (``out @ W_v^T``), so the cache holds only the latent and the
rope key (``cache.latent``) and no decode step expands the cached context (a prompt chunk
over float storage expands it: for many queries that is the cheaper form). The queries come from
``q_proj``, or through the low-rank ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``. Module
names are the checkpoint's.
"""

from __future__ import annotations

import functools
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from mlxformer.cache.codec import FLOAT_CODEC, Pack
from mlxformer.cache.latent import latent_attention
from mlxformer.cache.packed import PackedLayerCache, pack_segment
from mlxformer.cache.protocol import Cache
from mlxformer.models.config import ModelArgs
from mlxformer.models.mask import Mask, kept_rows
from mlxformer.models.norms import RMSNorm
from mlxformer.models.rope import RoPE
from mlxformer.models.rope_variants import make_rope

EXPAND_MIN = 16  # queries from which a float-cached chunk attends over expanded keys/values
LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps


class MLAttention(nn.Module):
    """``(B, L, hidden) -> (B, L, hidden)`` latent attention for layer ``layer_index``."""

    def __init__(self, args: ModelArgs, layer_index: int = 0):
        super().__init__()
        self.n_heads, self.rank = args.num_attention_heads, args.kv_lora_rank
        self.nope, self.rope_dims, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.q_lora_rank = args.q_lora_rank
        q_dims = self.n_heads * (self.nope + self.rope_dims)
        if args.q_lora_rank is None:
            self.q_proj = nn.Linear(args.hidden_size, q_dims, bias=False)
        else:
            self.q_a_proj = nn.Linear(args.hidden_size, args.q_lora_rank, bias=args.qkv_bias)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(args.q_lora_rank, q_dims, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(args.hidden_size, self.rank + self.rope_dims, bias=args.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, args.hidden_size, bias=args.o_proj_bias)
        self.scale = (self.nope + self.rope_dims) ** -0.5 if args.attention_scale is None else args.attention_scale
        rope = args.layer_rope(layer_index)
        assert rope is not None, "MLA layers always rotate their rope features"
        self.rope = make_rope(self.rope_dims, rope, args.max_position_embeddings, args.rope_traditional)

    def absorbed(self) -> tuple[mx.array, mx.array]:
        """``kv_b_proj`` split per head: the key part ``(H, nope, rank)`` and the value part
        ``(H, v, rank)`` (dequantized when the layer is quantized)."""
        layer = self.kv_b_proj
        weight = layer.weight
        if isinstance(layer, nn.QuantizedLinear):
            weight = mx.dequantize(weight, layer.scales, layer.biases, group_size=layer.group_size, bits=layer.bits)
        weight = weight.reshape(self.n_heads, self.nope + self.v_dim, self.rank)  # (H * (nope + v), rank) -> per head
        return weight[:, : self.nope], weight[:, self.nope :]

    def __call__(self, x: mx.array, mask: Mask, cache: Cache | None, rope_length: int | None = None,
                 keep: mx.array | None = None) -> mx.array:
        """``keep``: the positions ``(K,)`` whose outputs ``(B, K, hidden)`` are wanted (every
        row's latent is still cached)."""
        if cache is not None and cache.segments is not None:  # a packed step
            return self._packed(x, cache, rope_length, keep)
        offset = cache.offset if cache is not None else 0
        latent, k_rope = self._latent(x, offset, rope_length)
        keys, values = (k_rope,), (latent,)  # packs: float storage is a 1-tuple (``cache.codec``)
        if cache is not None:
            keys, values = cache.update_and_fetch(k_rope, latent)
        x, positions, mask, keep = self._query_rows(x, offset, mask, keep)
        q_nope, q_rope = self._queries(x, positions, rope_length)
        return self._output(self._attend(q_nope, q_rope, keys, values, mask, cache, self.absorbed), keep)

    def _packed(self, x: mx.array, cache: "PackedLayerCache", rope_length: int | None, keep: mx.array | None) -> mx.array:
        """A packed step's tokens ``x (1, T, hidden)`` (``cache/packed.py``): the projections run
        once for all of them; each segment's latents are written to its cache (``each``: every
        write before any fetching attention) and its queries attend there as a forward of its
        own would: over ``keep``'s rows alone where it would cut them (``_cuts``), in the
        absorbed or the expanded form. Only the kept rows ``(1, K, hidden)`` come out (a
        segment with none attends only if its cache writes where it attends)."""
        latent, k_rope = self._latent(x, cache.offset, rope_length)
        q_nope, q_rope = (cache.cut(q) for q in self._queries(x, cache.offset, rope_length))
        wanted, absorbed = cache.kept(keep), functools.cache(self.absorbed)  # split once, if any segment absorbs

        def attend(i: int, keys: Pack, values: Pack, mask: Mask) -> mx.array | None:
            segment, rows = cache.segments[i], wanted[i]  # rows: its kept tokens (None: all)
            q_n, q_r = q_nope[i], q_rope[i]  # (rows, H, length, D)
            cut = rows is not None and self._cuts(segment.rows, segment.length, segment.cache.offset, mask)
            if cut:
                if not rows:
                    return None  # its latents are written; its attention is not wanted
                index = mx.array(rows, dtype=mx.int32)
                q_n, q_r = q_n[:, :, index], q_r[:, :, index]
                mask = _kept_mask(mask, index, keys[0].shape[2], segment.length)  # the keys: as many as "causal" sees
            out = pack_segment(self._attend(q_n, q_r, keys, values, mask, segment.cache, absorbed), segment)
            if rows is None or cut:
                return out
            return out[:, :, mx.array(rows, dtype=mx.int32)] if rows else None  # every row attended (a ring row's chunk)

        outs = [o for o in cache.each(cache.cut(k_rope), cache.cut(latent), attend) if o is not None]
        return self._output(mx.concatenate(outs, axis=2), None)  # (1, H, K, v) -> (1, K, hidden)

    def _latent(self, x: mx.array, offset: int | mx.array, rope_length: int | None) -> tuple[mx.array, mx.array]:
        """Every row's latent ``(B, 1, L, rank)`` and rotated rope key ``(B, 1, L, rope)``, for the cache."""
        compressed = self.kv_a_proj_with_mqa(x)  # (B, L, rank + rope)
        latent = self.kv_a_layernorm(compressed[..., : self.rank])[:, None]
        return latent, self.rope(compressed[..., self.rank :][:, None], offset, rope_length)

    def _queries(self, x: mx.array, positions: int | mx.array, rope_length: int | None) -> tuple[mx.array, mx.array]:
        """The queries of rows ``x (B, Q, hidden)``: ``q_nope (B, H, Q, nope)`` and the rotated ``q_rope``."""
        B, Q, _ = x.shape
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(B, Q, self.n_heads, self.nope + self.rope_dims).transpose(0, 2, 1, 3)  # (B, H, Q, nope + rope)
        return q[..., : self.nope], self.rope(q[..., self.nope :], positions, rope_length)

    def _attend(self, q_nope: mx.array, q_rope: mx.array, keys: Pack, values: Pack, mask: Mask, cache: Cache | None,
                absorbed: Callable[[], tuple[mx.array, mx.array]]) -> mx.array:
        """The queries over the keys/values (as ``cache`` returned them), ``(B, H, Q, v)`` out:
        expanded for many queries over float storage, else absorbed (the weights ``absorbed`` gives)."""
        if q_nope.shape[2] >= EXPAND_MIN and len(values) == 1:  # many queries over float storage
            return (self.expanded(q_nope, q_rope, keys[0], values[0], mask) if cache is None
                    else cache.expanded_attention(q_nope, q_rope, keys, values, mask, self.expanded))
        w_k, w_v = absorbed()
        q_latent = q_nope @ w_k  # (B, H, Q, nope) @ (H, nope, rank) -> (B, H, Q, rank)
        if cache is not None:
            out = cache.latent_attention(q_latent, q_rope, keys, values, self.scale, mask)
        else:
            out = latent_attention(FLOAT_CODEC, q_latent, q_rope, keys, values, self.scale, mask)
        return out @ w_v.swapaxes(-1, -2)  # (B, H, Q, rank) @ (H, rank, v) -> (B, H, Q, v)

    def _output(self, out: mx.array, keep: mx.array | None) -> mx.array:
        """``o_proj`` of the attention's ``(B, H, Q, v)``, ``keep``'s rows only."""
        B, _, Q, _ = out.shape
        return self.o_proj(kept_rows(out.transpose(0, 2, 1, 3).reshape(B, Q, -1), keep))  # (B, Q, H * v)

    def _cuts(self, rows: int, length: int, offset: int | mx.array, mask: Mask) -> bool:
        """Whether a forward's queries run for its kept rows alone: one sequence (``rows`` 1) whose
        rotation takes a position per token, over a cache that does not mask where it attends
        (a ring row's chunk: ``None`` for many queries, whose pieces take the chunk's queries in
        order). Else every row's run (also with ``keep``) and the kept ones are cut after."""
        per_token = isinstance(self.rope, RoPE) and self.rope.config.type != "dynamic"
        return rows == 1 and isinstance(offset, int) and per_token and not (mask is None and length > 1)

    def _query_rows(self, x: mx.array, offset: int | mx.array, mask: Mask,
                    keep: mx.array | None) -> tuple[mx.array, int | mx.array, Mask, mx.array | None]:
        """The rows ``x (B, L, hidden)`` whose queries run, the offset rotating them, their mask
        and the output rows left to cut: ``keep``'s alone (each at its own position, the mask cut
        to them) where ``_cuts``, else every row."""
        B, L, _ = x.shape
        if keep is None or not self._cuts(B, L, offset, mask):
            return x, offset, mask, keep
        assert isinstance(offset, int)
        return x[:, keep], (offset + keep)[None], _kept_mask(mask, keep, offset + L, L), None  # positions (1, K)

    def expanded(self, q_nope: mx.array, q_rope: mx.array, k_rope: mx.array, latent: mx.array, mask: Mask) -> mx.array:
        """Attention with the keys and values expanded from the latents ``(B, 1, S, rank)``
        through ``kv_b_proj``: cheaper than the absorbed form for a prompt chunk of many queries
        (each key feature costs once, not once per query), and what transformers computes."""
        B, H, L, _ = q_nope.shape
        S = latent.shape[2]
        kv = self.kv_b_proj(latent[:, 0])  # (B, S, H * (nope + v))
        kv = kv.reshape(B, S, H, self.nope + self.v_dim).transpose(0, 2, 1, 3)  # (B, H, S, nope + v)
        k_rope = mx.broadcast_to(k_rope, (B, H, S, self.rope_dims))
        keys = mx.concatenate([kv[..., : self.nope], k_rope], axis=-1)  # (B, H, S, nope + rope)
        queries = mx.concatenate([q_nope, q_rope], axis=-1)  # (B, H, L, nope + rope)
        return mx.fast.scaled_dot_product_attention(queries, keys, kv[..., self.nope :], scale=self.scale, mask=mask)


def _kept_mask(mask: Mask, keep: mx.array, keys: int, length: int) -> Mask:
    """The mask of ``length`` queries over ``keys`` keys cut to the queries ``keep (K,)``: "causal"
    made explicit (each kept query sees the keys up to its own)."""
    if isinstance(mask, str):
        return mx.arange(keys)[None] <= (keys - length + keep)[:, None]  # (K, keys)
    return None if mask is None else mx.take(mask, keep, axis=-2)  # (..., L, S) -> (..., K, S)
