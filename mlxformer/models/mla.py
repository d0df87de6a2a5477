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

import re
from typing import Mapping, Protocol

import mlx.core as mx
import mlx.nn as nn

from mlxformer.cache.codec import FLOAT_CODEC
from mlxformer.cache.latent import latent_attention
from mlxformer.cache.protocol import Cache
from mlxformer.formats.tensors import Derivation
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
        B, L, _ = x.shape
        compressed = self.kv_a_proj_with_mqa(x)  # (B, L, rank + rope): every row's, for the cache
        latent = self.kv_a_layernorm(compressed[..., : self.rank])[:, None]  # (B, 1, L, rank)
        k_rope = compressed[..., self.rank :][:, None]  # (B, 1, L, rope)
        offset = cache.offset if cache is not None else 0
        k_rope = self.rope(k_rope, offset, rope_length)
        keys, values = (k_rope,), (latent,)  # packs: float storage is a 1-tuple (``cache.codec``)
        if cache is not None:
            keys, values = cache.update_and_fetch(k_rope, latent)
        x, positions, mask, keep = self._query_rows(x, offset, mask, keep)
        Q = x.shape[1]  # the rows whose queries run
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(B, Q, self.n_heads, self.nope + self.rope_dims).transpose(0, 2, 1, 3)  # (B, H, Q, nope + rope)
        q_nope, q_rope = q[..., : self.nope], self.rope(q[..., self.nope :], positions, rope_length)
        if Q >= EXPAND_MIN and len(values) == 1:  # many queries over float storage
            out = (self.expanded(q_nope, q_rope, keys[0], values[0], mask) if cache is None
                   else cache.expanded_attention(q_nope, q_rope, keys, values, mask, self.expanded))
        else:
            w_k, w_v = self.absorbed()
            q_latent = q_nope @ w_k  # (B, H, Q, nope) @ (H, nope, rank) -> (B, H, Q, rank)
            if cache is not None:
                out = cache.latent_attention(q_latent, q_rope, keys, values, self.scale, mask)
            else:
                out = latent_attention(FLOAT_CODEC, q_latent, q_rope, keys, values, self.scale, mask)
            out = out @ w_v.swapaxes(-1, -2)  # (B, H, Q, rank) @ (H, rank, v) -> (B, H, Q, v)
        # (B, H, Q, v) -> (B, Q, H * v)
        return self.o_proj(kept_rows(out.transpose(0, 2, 1, 3).reshape(B, Q, -1), keep))

    def _query_rows(self, x: mx.array, offset: int | mx.array, mask: Mask,
                    keep: mx.array | None) -> tuple[mx.array, int | mx.array, Mask, mx.array | None]:
        """The rows ``x (B, L, hidden)`` whose queries run, the offset rotating them, their mask
        and the output rows left to cut: ``keep``'s alone (each at its own position, the mask cut
        to them) for one sequence whose rotation takes a position per token; else every row (also
        over a cache that masks where it attends: a ring row's chunk, ``None`` for many queries,
        whose pieces take the chunk's queries in order)."""
        B, L, _ = x.shape
        per_token = isinstance(self.rope, RoPE) and self.rope.config.type != "dynamic"
        masked_later = mask is None and L > 1
        if keep is None or B != 1 or not isinstance(offset, int) or not per_token or masked_later:
            return x, offset, mask, keep
        S = offset + L  # the keys: the cached ones and this chunk's
        if isinstance(mask, str):  # "causal": the kept queries see the keys up to their own
            mask = mx.arange(S)[None] <= (S - L + keep)[:, None]  # (K, S)
        elif mask is not None:
            mask = mx.take(mask, keep, axis=-2)  # (..., L, S) -> (..., K, S)
        return x[:, keep], (offset + keep)[None], mask, None  # positions (1, K)

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


class Shaped(Protocol):
    shape: tuple[int, ...]
    dtype: mx.Dtype


_EMBED_Q = re.compile(r"^(.*\.self_attn)\.embed_q\.weight$")


def _dense(arrays: list[mx.array], in_dims: int) -> mx.array:
    """A part's float weight: dequantized in float32 when stored with scales (and biases): a
    code times a float16 scale needs more bits than float16 has (GGUF's Q8_0)."""
    if len(arrays) == 1:
        return arrays[0]
    weight, scales, *biases = arrays
    return mx.dequantize(weight, scales.astype(mx.float32), *(b.astype(mx.float32) for b in biases),
                         group_size=in_dims // scales.shape[-1], bits=weight.shape[-1] * 32 // in_dims)



def absorbed_kv_b(entries: Mapping[str, Shaped], args: ModelArgs) -> dict[str, Derivation]:
    """mlx-lm stores ``kv_b_proj`` split per head: ``embed_q`` ``(H, rank, nope)`` (its key part,
    transposed) and ``unembed_out`` ``(H, v, rank)``, each maybe quantized (bits and group size
    read off the shapes); llama.cpp's ``attn_k_b``/``attn_v_b`` are the same (``gguf_names``).
    Returns, per layer, the ``kv_b_proj.weight`` they make back (for ``Tensors.derived``)."""
    H, rank, nope, v = args.num_attention_heads, args.kv_lora_rank, args.qk_nope_head_dim, args.v_head_dim
    derivations: dict[str, Derivation] = {}
    for name in entries:
        match = _EMBED_Q.match(name)
        if match is None:
            continue
        prefix = match.group(1)
        parts = {part: [f"{prefix}.{part}.{kind}" for kind in ("weight", "scales", "biases")
                        if f"{prefix}.{part}.{kind}" in entries] for part in ("embed_q", "unembed_out")}
        members = parts["embed_q"] + parts["unembed_out"]
        split = len(parts["embed_q"])

        def join(arrays: list[mx.array], split: int = split) -> mx.array:
            wk, wv = _dense(arrays[:split], nope), _dense(arrays[split:], rank)
            # (H, rank, nope) -> (H, nope, rank); with (H, v, rank) -> (H * (nope + v), rank)
            return mx.concatenate([wk.swapaxes(-1, -2), wv], axis=1).reshape(H * (nope + v), rank)

        dtype = mx.float32 if split > 1 else entries[name].dtype
        derivations[f"{prefix}.kv_b_proj.weight"] = Derivation(tuple(members), (H * (nope + v), rank), dtype, join)
    return derivations
