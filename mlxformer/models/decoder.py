"""The one LLaMA-style decoder: residual blocks of GQA attention with RoPE and a gated MLP.

Every family is a set of ``ModelArgs`` fields: where the norms sit (``models.norms``), the MLP
(``models.mlp``), the rotary variant (``models.rope_variants``), soft-capping
(``models.attention_ops``), per-layer windows and RoPE, and a few scalars. Module names follow
the Hugging Face checkpoint keys (``model.layers.N.self_attn.q_proj``) so safetensors weights
load without a renaming table.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlxformer.embeddings.head import EmbeddingHead
from mlxformer.errors import MlxformerError
from mlxformer.models.mask import Mask, causal_mask_for, kept_rows, padded_mask
from mlxformer.cache.protocol import Cache
from mlxformer.cache.pool import record_writes
from mlxformer.models.attention_ops import fused_attention, position_query_scale, softcap_scores, softcapped_attention
from mlxformer.models.config import ModelArgs
from mlxformer.models.mla import MLAttention
from mlxformer.models.gated_delta import GatedDeltaNet
from mlxformer.models.feed_forward import make_mlp
from mlxformer.models.mlp import MLP, swiglu
from mlxformer.models import gemma4
from mlxformer.models.norms import NORM_LAYOUTS, RMSNorm, make_norm
from mlxformer.models.rope_variants import make_rope

# A layer's keys/values as the layers reading them get them (``kv_source``): what the cache
# returned, and the position of the first new token.
SharedKV = dict[int, tuple[object, object, "int | mx.array"]]

__all__ = ["Attention", "DecoderLayer", "DecoderStack", "MLP", "Model", "swiglu"]


class Attention(nn.Module):
    """Multi-head attention with grouped K/V heads, passed unrepeated to the fused kernel.

    ``layer_index`` (in the whole model) picks the layer's RoPE (none, local or global), head
    sizes, and whether it attends over another layer's keys/values (``kv_source``: no k/v
    projections of its own)."""

    def __init__(self, args: ModelArgs, layer_index: int = 0):
        super().__init__()
        self.layer_index, self.kv_source = layer_index, args.kv_source(layer_index)
        # whether later layers attend over this one's keys/values (Gemma 4's KV sharing)
        self.kv_read = args.num_kv_shared_layers > 0 and any(
            args.kv_source(i) == layer_index for i in range(layer_index + 1, args.num_hidden_layers))
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.layer_kv_heads(layer_index)
        self.head_dim = args.layer_head_dim(layer_index)
        self.scale = self.head_dim**-0.5 if args.attention_scale is None else args.attention_scale
        self.softcap = args.attn_logit_softcap
        self.q_dim, self.kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.fused_qkv = args.fused_qkv
        self.output_gate = args.attn_output_gate  # q_proj gives each head's queries, then its gate
        # Gemma 4's full layers: the values are the keys' projection (before the key norm)
        self.values_from_keys = args.attention_k_eq_v and args.layer_is_global(layer_index)
        self.v_norm_eps = args.rms_norm_eps if args.v_norm else None  # a scale-free RMSNorm on values
        own_kv = self.kv_source is None
        if args.fused_qkv:
            self.qkv_proj = nn.Linear(args.hidden_size, self.q_dim + 2 * self.kv_dim, bias=args.qkv_bias)
        else:
            self.q_proj = nn.Linear(args.hidden_size, self.q_dim * (2 if self.output_gate else 1), bias=args.qkv_bias)
            if own_kv:
                self.k_proj = nn.Linear(args.hidden_size, self.kv_dim, bias=args.qkv_bias)
            if own_kv and not self.values_from_keys:
                self.v_proj = nn.Linear(args.hidden_size, self.kv_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.q_dim, args.hidden_size, bias=args.o_proj_bias)
        # q/k RMSNorm per head (Qwen3, Gemma 3) or over the whole projection (OLMo 2)
        self.qk_norm = args.qk_norm_scope if args.qk_norm else None
        if args.qk_norm:
            q_dims, k_dims = (self.q_dim, self.kv_dim) if self.qk_norm == "projection" else (self.head_dim,) * 2
            self.q_norm = RMSNorm(q_dims, eps=args.rms_norm_eps, offset=args.norm_offset)
            if own_kv:
                self.k_norm = RMSNorm(k_dims, eps=args.rms_norm_eps, offset=args.norm_offset)
        if args.attention_sinks:  # gpt-oss: a learned logit per head that joins each softmax
            self.sinks = mx.zeros((self.n_heads,))
        rope = args.layer_rope(layer_index)
        rotary_dims = int(self.head_dim * args.partial_rotary_factor)
        self.rope = None if rope is None else make_rope(rotary_dims, rope, args.max_position_embeddings)
        # Ministral 3: position-dependent query scaling (beta 0: none)
        self.query_scale_beta, self.query_scale_length = args.query_scale_beta, args.query_scale_length

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Queries, keys and values ``(B, L, heads * head_dim)`` (split from ``qkv_proj`` if fused)."""
        if self.fused_qkv:
            qkv = self.qkv_proj(x)  # (B, L, q_dim + 2 * kv_dim)
            return qkv[..., : self.q_dim], qkv[..., self.q_dim : self.q_dim + self.kv_dim], qkv[..., self.q_dim + self.kv_dim :]
        keys = self.k_proj(x)
        return self.q_proj(x), keys, keys if self.values_from_keys else self.v_proj(x)

    def __call__(
        self, x: mx.array, mask: Mask, cache: Cache | None, rope_length: int | None = None, shared: SharedKV | None = None,
        keep: mx.array | None = None,
    ) -> mx.array:
        """``shared``: the keys/values of the layers that others read (``kv_source``), kept here
        by those layers and read by the others (their ``cache`` is their source's). ``keep``:
        the positions ``(K,)`` whose outputs ``(B, K, hidden)`` are wanted (every row's keys
        and values are still written and attended with)."""
        if self.kv_source is not None:
            return self._attend_shared(x, mask, cache, rope_length, shared, keep)
        B, L, _ = x.shape
        queries, keys, values = self.project(x)
        gate = None
        if self.output_gate:  # (B, L, heads * 2 * head_dim) -> (B, L, heads, 2 * head_dim): queries, gate
            queries, gate = mx.split(queries.reshape(B, L, self.n_heads, 2 * self.head_dim), 2, axis=-1)
            gate = gate.reshape(B, L, self.q_dim)
        if self.qk_norm == "projection":
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        # (B, L, heads * head_dim) -> (B, heads, L, head_dim)
        queries = queries.reshape(B, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        keys = keys.reshape(B, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        if self.qk_norm == "head":
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        if self.v_norm_eps is not None:
            values = mx.fast.rms_norm(values, None, self.v_norm_eps)
        offset = cache.offset if cache is not None else 0
        if self.rope is not None:
            queries, keys = self.rope(queries, offset, rope_length), self.rope(keys, offset, rope_length)
        sinks = self["sinks"] if "sinks" in self else None
        if self.query_scale_beta:
            scale = position_query_scale(offset, L, self.query_scale_beta, self.query_scale_length)
            queries = queries * scale.astype(queries.dtype)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        if shared is not None and self.kv_read:
            shared[self.layer_index] = (keys, values, offset)
        out = self._attend(queries, keys, values, mask, cache, sinks)
        # (B, heads, L, head_dim) -> (B, L, heads * head_dim)
        out = kept_rows(out.transpose(0, 2, 1, 3).reshape(B, L, -1), keep)
        return self.o_proj(out if gate is None else out * mx.sigmoid(kept_rows(gate, keep)))

    def _attend(self, queries: mx.array, keys: object, values: object, mask: Mask, cache: Cache | None,
                sinks: mx.array | None = None) -> mx.array:
        """Queries ``(B, heads, L, head_dim)`` over the keys/values (as ``cache`` returned them)."""
        if cache is not None:
            return cache.attention(queries, keys, values, scale=self.scale, mask=mask, softcap=self.softcap, sinks=sinks)
        if self.softcap is not None:
            return softcapped_attention(queries, keys, values, self.scale, mask, self.softcap, sinks)  # type: ignore[arg-type]
        return fused_attention(queries, keys, values, self.scale, mask, sinks)  # type: ignore[arg-type]

    def _attend_shared(self, x: mx.array, mask: Mask, cache: Cache | None, rope_length: int | None,
                       shared: SharedKV | None, keep: mx.array | None = None) -> mx.array:
        """Attention over the keys/values layer ``kv_source`` computed in this forward."""
        if shared is None or self.kv_source not in shared:
            raise ValueError(f"layer {self.layer_index} reads layer {self.kv_source}'s keys/values, which did not run")
        keys, values, offset = shared[self.kv_source]
        B, L, _ = x.shape
        # (B, L, heads * head_dim) -> (B, heads, L, head_dim)
        queries = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        if self.qk_norm == "head":
            queries = self.q_norm(queries)
        if self.rope is not None:
            queries = self.rope(queries, offset, rope_length)
        out = self._attend(queries, keys, values, mask, cache)
        return self.o_proj(kept_rows(out.transpose(0, 2, 1, 3).reshape(B, L, -1), keep))


class DecoderLayer(nn.Module):
    """Residual block: attention then the MLP, with the norms where ``args.norm_layout`` puts
    them. ``window`` is the sliding window this layer attends with (None: all the context)."""

    def __init__(self, args: ModelArgs, layer_index: int = 0):
        super().__init__()
        self.window = args.layer_window(layer_index)
        # the mixer: attention (grouped-query or latent), or Gated DeltaNet on a recurrent state (``linear_attn``)
        self.recurrent = args.layer_is_linear(layer_index)
        self.mixer_name = "linear_attn" if self.recurrent else "self_attn"
        if self.recurrent:
            self[self.mixer_name] = GatedDeltaNet(args, layer_index)
        else:
            self[self.mixer_name] = MLAttention(args, layer_index) if args.attention_type == "mla" else Attention(args, layer_index)
        self.kv_source = args.kv_source(layer_index)  # the layer whose cache this one reads (None: its own)
        self.mlp_name = args.mlp_name  # the checkpoint's name for the block (Mixtral: block_sparse_moe)
        wide = args.double_wide_mlp and self.kv_source is not None  # Gemma 4's KV-shared layers
        mlp_args = dataclasses.replace(args, intermediate_size=2 * args.intermediate_size) if wide else args
        self[args.mlp_name] = make_mlp(mlp_args, layer_index)
        # Gemma 4: per-layer inputs, experts beside the MLP, a stored output scalar
        self.experts_beside, self.activation = args.experts_beside_mlp, args.hidden_act
        for name, module in gemma4.layer_modules(args).items():
            self[name] = module
        if args.layer_scalar:
            self.layer_scalar = mx.ones((1,))
        self.norm_layout = args.norm_layout  # a string: kept out of the parameter tree
        for name in NORM_LAYOUTS[args.norm_layout]:
            if name is not None:
                self[name] = make_norm(args, args.hidden_size)
        self.residual_scale = args.residual_scale

    def _norm(self, index: int, x: mx.array) -> mx.array:
        name = NORM_LAYOUTS[self.norm_layout][index]
        return x if name is None else self[name](x)

    def _residual(self, x: mx.array, out: mx.array) -> mx.array:
        return x + (out if self.residual_scale == 1.0 else out * self.residual_scale)

    def __call__(
        self, x: mx.array, mask: Mask, cache: Cache | None, rope_length: int | None = None,
        shared: SharedKV | None = None, per_layer_input: mx.array | None = None, keep: mx.array | None = None,
    ) -> mx.array:
        """``shared``: keys/values passed between layers (``Attention``); ``per_layer_input``:
        this layer's extra input ``(B, T, size)`` (Gemma 4). ``keep``: the positions ``(K,)``
        whose outputs ``(B, K, hidden)`` are wanted: the mixer still writes every row's keys
        and values, and the rest of the block runs on those rows only."""
        mixer = self[self.mixer_name]
        if self.recurrent:  # its state takes every row; its output rows are cut after
            mixed = kept_rows(mixer(self._norm(0, x), mask, cache, rope_length), keep)
        elif shared is None:
            mixed = mixer(self._norm(0, x), mask, cache, rope_length, keep=keep)
        else:
            mixed = mixer(self._norm(0, x), mask, cache, rope_length, shared, keep=keep)
        x, per_layer_input = kept_rows(x, keep), None if per_layer_input is None else kept_rows(per_layer_input, keep)
        h = self._residual(x, self._norm(1, mixed))
        ff = self[self.mlp_name](self._norm(2, h))
        if self.experts_beside:
            ff = gemma4.experts_beside_mlp(self, h, ff)
        out = self._residual(h, self._norm(3, ff))
        if per_layer_input is not None:
            out = gemma4.add_per_layer_input(self, self.activation, out, per_layer_input)
        return out * self["layer_scalar"] if "layer_scalar" in self else out


def token_positions(cache: Sequence[Cache] | None, length: int, limit: int) -> mx.array:
    """The positions ``(1 or B, length)`` of the tokens a forward over ``cache`` adds, from the
    first layer's offset as RoPE reads it: an int, ``(B,)`` (a batch: each row from its own),
    or ``(1, T)`` (a packed step: each token its own). An int offset past ``limit`` (learned
    positions end there) raises."""
    offset = 0 if not cache else cache[0].offset
    if isinstance(offset, mx.array):
        return offset if offset.ndim == 2 else offset[:, None] + mx.arange(length)  # (B,) -> (B, length)
    if offset + length > limit:
        raise MlxformerError(f"position {offset + length - 1} is past this model's {limit} learned positions")
    return mx.arange(offset, offset + length)[None]


class DecoderStack(nn.Module):
    """Embedding, the layer stack and the final norm (HF's ``model.`` prefix).

    A pipeline stage holds ``num_layers`` consecutive layers from the model's ``first_layer``
    (numbered from 0 here) and, when ``with_ends``, the embedding and final norm too."""

    def __init__(self, args: ModelArgs, num_layers: int | None = None, with_ends: bool = True, first_layer: int = 0):
        super().__init__()
        if with_ends:
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
            if args.position_type == "learned":  # GPT-2's wpe
                self.embed_positions = nn.Embedding(args.max_position_embeddings, args.hidden_size)
        count = args.num_hidden_layers if num_layers is None else num_layers
        self.layers = [DecoderLayer(args, first_layer + i) for i in range(count)]
        if with_ends:
            self.norm = make_norm(args, args.hidden_size)
            if args.hidden_size_per_layer_input:  # Gemma 4
                for name, module in gemma4.stack_modules(args).items():
                    self[name] = module


class Model(nn.Module):
    """A LLaMA-family causal LM: ``model(tokens (B, T)) -> logits (B, T, vocab)``.

    ``num_layers``/``with_ends`` build one pipeline stage (see ``DecoderStack``); a stage
    without ends only runs ``run_layers``."""

    def __init__(self, args: ModelArgs, num_layers: int | None = None, with_ends: bool = True, first_layer: int = 0):
        super().__init__()
        self.args = args
        # Set by ``use_remote_layers``: the layers other pipeline stages run after ours.
        self._remote_layers: Callable[[mx.array, int | None], mx.array] | None = None
        # Set by ``watch_hidden``: sees each forward's final hidden states with its caches (native MTP).
        self._hidden_watch: Callable[[mx.array, Sequence[Cache]], None] | None = None
        self.model = DecoderStack(args, num_layers, with_ends, first_layer)
        # how ``mlxformer.embeddings`` pools this model's hidden states (the loader reads the checkpoint's)
        self.embedding_head = EmbeddingHead()
        self.adapter_bank: object | None = None  # the LoRA adapters it carries (``adapters.attach_adapters``)
        if args.num_kv_shared_layers and 0 < len(self.layers) < args.num_hidden_layers:
            raise MlxformerError("a model whose layers share keys/values (Gemma 4) runs in one process, not a pipeline")
        if with_ends and args.head == "lm" and not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if with_ends and args.head == "score":  # a cross-encoder's classifier (``*ForSequenceClassification``)
            self.score = nn.Linear(args.hidden_size, args.num_labels, bias=False)

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    @property
    def cache_layers(self) -> list[DecoderLayer]:
        """The layers with a cache of their own (``make_cache``'s, in order): all but those
        reading another layer's keys/values (Gemma 4's last ``num_kv_shared_layers``)."""
        return [layer for layer in self.model.layers if layer.kv_source is None]

    def hidden_states(
        self, inputs: mx.array, cache: Sequence[Cache] | None = None, rope_length: int | None = None,
        keep: mx.array | None = None, watch: bool = True, valid: mx.array | None = None,
    ) -> mx.array:
        """Final-norm hidden states ``(B, T, hidden)`` for token ids ``(B, T)``. ``rope_length``:
        the whole prompt's length when this is one chunk of it (see ``RoPE``). ``keep``: only
        the positions ``(K,)`` wanted, ``(B, K, hidden)`` out: the last layer computes the rest
        of its rows only as far as the caches need (their keys/values). ``watch``: hand the
        hidden rows to the watch (a packed step's rows go to it by sequence: ``observe``).
        ``valid``: ``(B, T)`` bool, the real tokens of rows padded at the end (no cache: an
        embedding batch)."""
        watched = self.watching and cache is not None and watch
        last = None if watched or self._remote_layers is not None else keep  # the last layer is ours
        h, extra = self.embed(inputs, cache)
        h = self.run_layers(h, cache, rope_length, extra, last, valid)
        if self._remote_layers is not None:
            h = self._remote_layers(h, rope_length)
        h = self.model.norm(h)
        if watched:
            self._hidden_watch(h, cache)  # type: ignore[misc]
        return h if last is not None else kept_rows(h, keep)

    def embed(self, inputs: mx.array, cache: Sequence[Cache] | None = None) -> tuple[mx.array, mx.array | None]:
        """The first layer's input ``(B, T, hidden)`` for token ids ``(B, T)`` (the embeddings,
        scaled, plus the learned positions after ``cache``'s), and Gemma 4's per-layer inputs
        ``(B, T, layers, size)`` (None for every other family)."""
        h = self.model.embed_tokens(inputs)  # (B, T, hidden)
        if self.args.embedding_scale != 1.0:  # in the activation dtype, as transformers does
            h = h * mx.array(self.args.embedding_scale, dtype=h.dtype)
        if self.args.position_type == "learned":
            h = h + self.model.embed_positions(token_positions(cache, inputs.shape[1], self.args.max_position_embeddings))
        extra = gemma4.per_layer_inputs(self.model, self.args, inputs, h) if self.args.hidden_size_per_layer_input else None
        return h, extra

    def run_layers(
        self, h: mx.array, cache: Sequence[Cache] | None = None, rope_length: int | None = None,
        per_layer_inputs: mx.array | None = None, keep: mx.array | None = None, valid: mx.array | None = None,
        before_layer: Callable[[int, mx.array], None] | None = None,
    ) -> mx.array:
        """This model's decoder layers on hidden states ``(B, T, hidden)``; ``cache`` holds one
        cache per layer of ``cache_layers``, and a layer reading another's keys/values gets that
        layer's. ``per_layer_inputs``: each layer's extra input ``(B, T, layers, size)`` (Gemma 4).
        ``keep``: the positions ``(K,)`` the last layer outputs (``DecoderLayer``). ``valid``: the
        real tokens ``(B, T)`` of padded rows (``hidden_states``). ``before_layer(i, h)``: called
        with each layer's input before it runs (calibration loads that layer's weights there).
        A cache records what the forward wrote once it is built (``cache.pool.record_writes``: a pool's
        rows, shared by their layers, move once)."""
        if not self.layers:
            return kept_rows(h, keep)
        query_len = h.shape[1]
        masks: dict[int | None, Mask] = {}  # one mask per window, from the first cache of that window
        shared: SharedKV | None = {} if self.args.num_kv_shared_layers else None  # keys/values read by later layers
        for i, layer in enumerate(self.layers):
            if before_layer is not None:
                before_layer(i, h)
            layer_cache = None if cache is None else cache[i if layer.kv_source is None else layer.kv_source]
            rows = keep if i == len(self.layers) - 1 else None
            if layer.recurrent:  # no mask: the state holds the past
                h = layer(h, None, layer_cache, rope_length, keep=rows)
                continue
            if layer.window not in masks:
                masks[layer.window] = self._mask(query_len, layer.window, layer_cache, valid)
            extra = None if per_layer_inputs is None else per_layer_inputs[:, :, i, :]
            h = layer(h, masks[layer.window], layer_cache, rope_length, shared, extra, rows)
        if cache is not None:
            record_writes(cache)
        return h

    def _mask(self, query_len: int, window: int | None, cache: Cache | None, valid: mx.array | None) -> Mask:
        """The attention mask of a layer attending with ``window`` over ``cache`` (None: only this
        forward's tokens, of which ``valid`` says which are real when the rows are padded)."""
        if cache is not None:
            return cache.make_mask(query_len, window)
        if valid is None and not self.args.bidirectional:
            return causal_mask_for(query_len, query_len, window)
        real = mx.ones((1, query_len), dtype=mx.bool_) if valid is None else valid
        return padded_mask(real, window, self.args.bidirectional)

    def use_remote_layers(self, run: Callable[[mx.array, int | None], mx.array]) -> None:
        """Pass hidden states (and the RoPE length, see ``hidden_states``) through ``run``
        between this model's layers and the final norm: the layers the other stages of a
        pipeline hold."""
        self._remote_layers = run

    def watch_hidden(self, watch: Callable[[mx.array, Sequence[Cache]], None] | None) -> None:
        """Call ``watch(hidden (B, T, hidden), caches)`` after every forward over caches with its
        final-norm hidden states (lazy): native MTP drafts from them (``mlxformer.speculative.mtp``)."""
        self._hidden_watch = watch

    @property
    def watching(self) -> bool:
        """Whether a watch (``watch_hidden``) reads the forwards' hidden states."""
        return self._hidden_watch is not None

    def observe(self, hidden: mx.array, cache: Sequence[Cache]) -> None:
        """Hand the watch (``watch_hidden``) hidden states ``(1, T, hidden)`` computed for
        ``cache`` in a forward over several sequences' caches (a packed step's)."""
        if self._hidden_watch is not None:
            self._hidden_watch(hidden, cache)

    def kv_dtype(self) -> mx.Dtype:
        """The dtype the caches hold keys and values in: what this model's layers output for one
        token (a lazy graph, never evaluated; a pipeline's other stages are not asked)."""
        h, extra = self.embed(mx.array([[0]]))
        return self.run_layers(h, per_layer_inputs=extra).dtype

    def logits(self, hidden: mx.array) -> mx.array:
        """Project hidden states ``(B, T, hidden)`` to vocabulary logits ``(B, T, vocab)``."""
        a = self.args
        if a.head != "lm":
            if a.head == "score":  # the classifier's logits (num_labels)
                return self.score(hidden)
            raise MlxformerError("this model has no language-model head: it makes embeddings, not text")
        logits = self.model.embed_tokens.as_linear(hidden) if a.tie_word_embeddings else self.lm_head(hidden)
        if a.logits_scale != 1.0:
            logits = logits * a.logits_scale
        if a.final_logit_softcap is not None:
            logits = softcap_scores(logits, a.final_logit_softcap)
        return logits

    def __call__(self, inputs: mx.array, cache: Sequence[Cache] | None = None) -> mx.array:
        return self.logits(self.hidden_states(inputs, cache))

    def last_logits(
        self, inputs: mx.array, cache: Sequence[Cache] | None = None, rope_length: int | None = None
    ) -> mx.array:
        """Logits ``(B, vocab)`` of the last position only: the last layer's MLP and the
        vocabulary projection are skipped for every other position (``keep``)."""
        T = inputs.shape[1]
        keep = None if T == 1 else mx.array([T - 1])
        return self.logits(self.hidden_states(inputs, cache, rope_length, keep)[:, -1, :])
