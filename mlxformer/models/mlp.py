"""The dense feed-forward blocks and the gate functions every block (dense or experts) uses.

Which block a layer gets is ``ModelArgs.mlp_type``'s row of ``models.feed_forward.MLP_TYPES``.
Every block maps ``(B, T, hidden) -> (B, T, hidden)``.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from mlxformer.errors import MlxformerError
from mlxformer.models.config import ModelArgs


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up`` as one fused kernel: no temporaries the size of the hidden layer."""
    return nn.silu(gate) * up


@partial(mx.compile, shapeless=True)
def geglu(gate: mx.array, up: mx.array) -> mx.array:
    """``gelu_tanh(gate) * up`` (Gemma's GeGLU; transformers' ``gelu_pytorch_tanh``)."""
    return nn.gelu_approx(gate) * up


SWIGLU_ALPHA = 1.702  # transformers' GptOssConfig swiglu_alpha
SWIGLU_LIMIT = 7.0  # and swiglu_limit


@partial(mx.compile, shapeless=True)
def clamped_swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``(clip(up, -7, 7) + 1) * g * sigmoid(1.702 g)`` with ``g = min(gate, 7)`` (gpt-oss's experts)."""
    gate = mx.minimum(gate, SWIGLU_LIMIT)
    up = mx.clip(up, -SWIGLU_LIMIT, SWIGLU_LIMIT)
    return (up + 1) * (gate * mx.sigmoid(gate * SWIGLU_ALPHA))


GATES: dict[str, Callable[[mx.array, mx.array], mx.array]] = {"silu": swiglu, "gelu_tanh": geglu,
                                                               "swiglu_clamped": clamped_swiglu}
# The same activations in an ungated MLP (GPT-2's ``gelu_new`` is the tanh GELU)
ACTIVATIONS: dict[str, Callable[[mx.array], mx.array]] = {"silu": nn.silu, "gelu_tanh": nn.gelu_approx}


class MLP(nn.Module):
    """Gated feed-forward: ``down(act(gate(x)) * up(x))``, SwiGLU or GeGLU."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        check_width(args)
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)
        self.activation = args.hidden_act  # a GATES key (a name, so the module deep-copies)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(GATES[self.activation](self.gate_proj(x), self.up_proj(x)))


class FusedMLP(nn.Module):
    """The gated MLP with gate and up in one ``gate_up_proj`` (Phi-3's layout, kept as stored)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        check_width(args)
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)
        self.activation = args.hidden_act  # a GATES key (a name, so the module deep-copies)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)  # (B, T, 2 * inter) -> 2 x (B, T, inter)
        return self.down_proj(GATES[self.activation](gate, up))


class PlainMLP(nn.Module):
    """The ungated feed-forward ``down(act(up(x)))`` (GPT-2's ``c_fc``/``c_proj``)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)
        self.activation = args.hidden_act  # an ACTIVATIONS key

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(ACTIVATIONS[self.activation](self.up_proj(x)))


def dense_mlp(args: ModelArgs, layer_index: int) -> nn.Module:
    """The dense MLP: gated (fused or not, as the checkpoint stores it) or plain."""
    if not args.gated_mlp:
        return PlainMLP(args)
    return FusedMLP(args) if args.fused_gate_up else MLP(args)


def check_width(args: ModelArgs) -> None:
    """Refuse a dense MLP without a width: ``intermediate_size`` may be absent from a config only
    when no layer has one (Qwen3.5-MoE's are all experts)."""
    if args.intermediate_size <= 0:
        raise MlxformerError("config.json intermediate_size must be a positive integer: the model has a dense MLP")
