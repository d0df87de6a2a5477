"""gpt-oss's mixture of experts: a biased router whose top-k logits are softmaxed, experts
with biases, and the clamped SwiGLU.

Names are HF's and mlx-lm's (``mlp.router``, ``mlp.experts.{gate,up,down}_proj``); HF's fused
``gate_up_proj`` (gate on even, up on odd columns) is split at load (``formats.gpt_oss``).
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn

from mlxformer.models.config import ModelArgs
from mlxformer.models.mlp import GATES, MLP_TYPES
from mlxformer.models.moe import SparseMoE, SwitchGLU

SWIGLU_ALPHA = 1.702  # transformers' GptOssConfig swiglu_alpha
SWIGLU_LIMIT = 7.0  # and swiglu_limit


@partial(mx.compile, shapeless=True)
def clamped_swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``(clip(up, -7, 7) + 1) * g * sigmoid(1.702 g)`` with ``g = min(gate, 7)`` (gpt-oss)."""
    gate = mx.minimum(gate, SWIGLU_LIMIT)
    up = mx.clip(up, -SWIGLU_LIMIT, SWIGLU_LIMIT)
    return (up + 1) * (gate * mx.sigmoid(gate * SWIGLU_ALPHA))


class TopKSoftmaxMoE(SparseMoE):
    """Router with a bias; softmax over the chosen top-k logits; biased experts."""

    experts_name = "experts"

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        self.top_k = args.num_experts_per_tok
        self.router = nn.Linear(args.hidden_size, args.num_experts, bias=True)
        self.experts = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts, args.hidden_act,
                                 bias=True)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Expert indices ``(N, k)`` and their weights ``(N, k)`` (float32) for rows ``x (N, h)``."""
        logits = self.router(x).astype(mx.float32)  # (N, experts)
        indices = mx.argpartition(-logits, kth=self.top_k - 1, axis=-1)[:, : self.top_k]
        weights = mx.softmax(mx.take_along_axis(logits, indices, axis=-1), axis=-1)
        return mx.stop_gradient(indices), weights


GATES["swiglu_clamped"] = clamped_swiglu
MLP_TYPES["moe_topk_softmax"] = lambda args, layer_index: TopKSoftmaxMoE(args)
