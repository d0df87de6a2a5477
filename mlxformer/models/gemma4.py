"""Gemma 4's components beside the one decoder's attention and MLP (``models.gemma4_family``
reads its config): per-layer token inputs and the routed experts block beside the MLP.

Per-layer inputs: a second embedding table ``embed_tokens_per_layer`` ``(vocab, layers * size)``
gives each token ``size`` features per layer, which are averaged (scale ``2**-0.5``) with a
normed projection of the scaled input embedding (``per_layer_model_projection``); after its MLP
each layer adds ``post_per_layer_input_norm(per_layer_projection(act(per_layer_input_gate(h)) * x))``.

Experts: ``router`` (a scale-free RMSNorm, a learned ``scale``, softmax over ``proj``, top-k
renormalised and multiplied by ``per_expert_scale``) picks experts run by ``experts.switch_glu``
(``moe.SwitchGLU``, mlx-lm's names; HF's fused ``experts.gate_up_proj`` is split at load by
``formats.expert_layouts``) on ``pre_feedforward_layernorm_2`` of the layer's residual stream; the
MLP's and the experts' outputs are normed (``post_feedforward_layernorm_1``/``_2``) and summed.
Module names are the checkpoint's, set on the decoder's stack and layers.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from mlxformer.models.config import ModelArgs
from mlxformer.models.mlp import GATES
from mlxformer.models.moe import SwitchGLU
from mlxformer.models.norms import RMSNorm


# --- per-layer inputs ---------------------------------------------------------------------


def stack_modules(args: ModelArgs) -> dict[str, nn.Module]:
    """The model-level modules of the per-layer inputs (on ``DecoderStack``)."""
    size, total = args.hidden_size_per_layer_input, args.num_hidden_layers * args.hidden_size_per_layer_input
    return {
        "embed_tokens_per_layer": nn.Embedding(args.vocab_size_per_layer_input, total),
        "per_layer_model_projection": nn.Linear(args.hidden_size, total, bias=False),
        "per_layer_projection_norm": RMSNorm(size, eps=args.rms_norm_eps),
    }


def per_layer_inputs(stack: nn.Module, args: ModelArgs, inputs: mx.array, h: mx.array) -> mx.array:
    """Each layer's extra input ``(B, T, layers, size)`` for tokens ``(B, T)`` whose scaled
    embeddings are ``h (B, T, hidden)``."""
    B, T = inputs.shape
    size = args.hidden_size_per_layer_input
    tokens = stack.embed_tokens_per_layer(inputs)
    tokens = tokens * mx.array(math.sqrt(size), dtype=tokens.dtype)
    context = stack.per_layer_model_projection(h) * (args.hidden_size**-0.5)
    # (B, T, layers * size) -> (B, T, layers, size)
    context = stack.per_layer_projection_norm(context.reshape(B, T, -1, size))
    return (context + tokens.reshape(B, T, -1, size)) * (2.0**-0.5)


def layer_modules(args: ModelArgs) -> dict[str, nn.Module]:
    """The layer-level modules of the per-layer inputs and the experts beside the MLP."""
    modules: dict[str, nn.Module] = {}
    if args.hidden_size_per_layer_input:
        size = args.hidden_size_per_layer_input
        modules.update(per_layer_input_gate=nn.Linear(args.hidden_size, size, bias=False),
                       per_layer_projection=nn.Linear(size, args.hidden_size, bias=False),
                       post_per_layer_input_norm=RMSNorm(args.hidden_size, eps=args.rms_norm_eps))
    if args.experts_beside_mlp:
        modules.update(router=Router(args), experts=Experts(args))
        for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
            modules[name] = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
    return modules


def add_per_layer_input(layer: nn.Module, activation: str, h: mx.array, per_layer_input: mx.array) -> mx.array:
    """``h (B, T, hidden)`` plus the layer's use of its input ``(B, T, size)``."""
    gated = GATES[activation](layer.per_layer_input_gate(h), per_layer_input)
    return h + layer.post_per_layer_input_norm(layer.per_layer_projection(gated))


# --- experts beside the MLP -----------------------------------------------------------------


class Router(nn.Module):
    """Top-k of a softmax over experts from the scale-free-normed, scaled rows."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.proj = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.scale = mx.ones((args.hidden_size,))
        self.per_expert_scale = mx.ones((args.num_experts,))
        self.top_k, self.eps, self.root = args.num_experts_per_tok, args.rms_norm_eps, args.hidden_size**-0.5

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Expert indices ``(N, k)`` and weights ``(N, k)`` (float32) for rows ``x (N, hidden)``."""
        x = mx.fast.rms_norm(x, None, self.eps) * self.scale * self.root
        probs = mx.softmax(self.proj(x).astype(mx.float32), axis=-1)  # (N, experts)
        indices = mx.stop_gradient(mx.argpartition(-probs, kth=self.top_k - 1, axis=-1)[:, : self.top_k])
        weights = mx.take_along_axis(probs, indices, axis=-1)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        return indices, weights * self.per_expert_scale[indices].astype(mx.float32)


class Experts(nn.Module):
    """The routed experts (``switch_glu``), weighted and summed per row."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.switch_glu = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts, args.hidden_act)

    def __call__(self, x: mx.array, indices: mx.array, weights: mx.array) -> mx.array:
        routed = self.switch_glu(x, indices)  # (N, k, hidden)
        return (routed * weights[..., None].astype(routed.dtype)).sum(axis=1)


def experts_beside_mlp(layer: nn.Module, residual: mx.array, mlp_out: mx.array) -> mx.array:
    """The MLP's output ``(B, T, hidden)`` joined by the experts' on the layer's ``residual``."""
    B, T, H = residual.shape
    rows = residual.reshape(B * T, H)  # (B, T, h) -> (N, h)
    indices, weights = layer.router(rows)
    routed = layer.experts(layer.pre_feedforward_layernorm_2(rows), indices, weights).reshape(B, T, H)
    return layer.post_feedforward_layernorm_1(mlp_out) + layer.post_feedforward_layernorm_2(routed)
