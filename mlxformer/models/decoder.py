"""The one LLaMA-style decoder: pre-norm blocks, GQA attention with RoPE, SwiGLU MLP.

Module names follow the Hugging Face checkpoint keys (``model.layers.N.self_attn.q_proj``)
so safetensors weights load without a renaming table.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlxformer.models.mask import Mask, causal_mask_for
from mlxformer.cache.protocol import Cache
from mlxformer.models.config import ModelArgs
from mlxformer.models.rope import RoPE


class Attention(nn.Module):
    """Multi-head attention with grouped K/V heads, passed unrepeated to the fused kernel."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(args.hidden_size, q_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.hidden_size, kv_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.hidden_size, kv_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(q_dim, args.hidden_size, bias=args.o_proj_bias)
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.qk_norm = args.qk_norm
        self.rope = RoPE(self.head_dim, args.rope, args.max_position_embeddings)

    def __call__(self, x: mx.array, mask: Mask, cache: Cache | None, rope_length: int | None = None) -> mx.array:
        B, L, _ = x.shape
        # (B, L, heads * head_dim) -> (B, heads, L, head_dim)
        queries = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        if self.qk_norm:
            queries = self.q_norm(queries)
            keys = self.k_norm(keys)
        offset = cache.offset if cache is not None else 0
        queries = self.rope(queries, offset, rope_length)
        keys = self.rope(keys, offset, rope_length)
        if cache is None:
            out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        else:
            keys, values = cache.update_and_fetch(keys, values)
            out = cache.attention(queries, keys, values, scale=self.scale, mask=mask)
        # (B, heads, L, head_dim) -> (B, L, heads * head_dim)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up`` as one fused kernel: no temporaries the size of the hidden layer."""
    return nn.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Mask, cache: Cache | None, rope_length: int | None = None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache, rope_length)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderStack(nn.Module):
    """Embedding, the layer stack and the final norm (HF's ``model.`` prefix).

    A pipeline stage holds ``num_layers`` consecutive layers (numbered from 0 here) and, when
    ``with_ends``, the embedding and final norm too."""

    def __init__(self, args: ModelArgs, num_layers: int | None = None, with_ends: bool = True):
        super().__init__()
        if with_ends:
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        count = args.num_hidden_layers if num_layers is None else num_layers
        self.layers = [DecoderLayer(args) for _ in range(count)]
        if with_ends:
            self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(nn.Module):
    """A LLaMA-family causal LM: ``model(tokens (B, T)) -> logits (B, T, vocab)``.

    ``num_layers``/``with_ends`` build one pipeline stage (see ``DecoderStack``); a stage
    without ends only runs ``run_layers``."""

    def __init__(self, args: ModelArgs, num_layers: int | None = None, with_ends: bool = True):
        super().__init__()
        self.args = args
        # Set by ``use_remote_layers``: the layers other pipeline stages run after ours.
        self._remote_layers: Callable[[mx.array], mx.array] | None = None
        self.model = DecoderStack(args, num_layers, with_ends)
        if with_ends and not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    def hidden_states(
        self, inputs: mx.array, cache: Sequence[Cache] | None = None, rope_length: int | None = None
    ) -> mx.array:
        """Final-norm hidden states ``(B, T, hidden)`` for token ids ``(B, T)``. ``rope_length``:
        the whole prompt's length when this is one chunk of it (see ``RoPE``)."""
        h = self.model.embed_tokens(inputs)  # (B, T, hidden)
        h = self.run_layers(h, cache, rope_length)
        if self._remote_layers is not None:
            h = self._remote_layers(h)
        return self.model.norm(h)

    def run_layers(
        self, h: mx.array, cache: Sequence[Cache] | None = None, rope_length: int | None = None
    ) -> mx.array:
        """This model's decoder layers on hidden states ``(B, T, hidden)``."""
        if not self.layers:
            return h
        query_len = h.shape[1]
        if cache is None:
            mask = causal_mask_for(query_len, query_len, self.args.sliding_window)
            layer_caches: Sequence[Cache | None] = [None] * len(self.layers)
        else:
            mask = cache[0].make_mask(query_len, self.args.sliding_window)
            layer_caches = cache
        for layer, layer_cache in zip(self.layers, layer_caches):
            h = layer(h, mask, layer_cache, rope_length)
        return h

    def use_remote_layers(self, run: Callable[[mx.array], mx.array]) -> None:
        """Pass hidden states through ``run`` between this model's layers and the final norm:
        the layers the other stages of a pipeline hold."""
        self._remote_layers = run

    def logits(self, hidden: mx.array) -> mx.array:
        """Project hidden states ``(B, T, hidden)`` to vocabulary logits ``(B, T, vocab)``."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def __call__(self, inputs: mx.array, cache: Sequence[Cache] | None = None) -> mx.array:
        return self.logits(self.hidden_states(inputs, cache))

    def last_logits(
        self, inputs: mx.array, cache: Sequence[Cache] | None = None, rope_length: int | None = None
    ) -> mx.array:
        """Logits ``(B, vocab)`` of the last position only: the vocabulary projection, the
        largest matmul of a small model, is skipped for every other position."""
        return self.logits(self.hidden_states(inputs, cache, rope_length)[:, -1, :])

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Drop checkpoint keys that carry no weights for this decoder."""
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
            weights.pop("lm_head.scales", None)
            weights.pop("lm_head.biases", None)
        return weights
