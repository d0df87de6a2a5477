"""gpt-oss's mixture of experts: a biased router whose top-k logits are softmaxed, experts
with biases, and the clamped SwiGLU (``mlp.clamped_swiglu``).

Names are HF's and mlx-lm's (``mlp.router``, ``mlp.experts.{gate,up,down}_proj``); HF's fused
``gate_up_proj`` (gate on even, up on odd columns) is split at load (``formats.gpt_oss``).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxformer.models.config import ModelArgs
from mlxformer.models.moe import SparseMoE, SwitchGLU


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



def gpt_oss_mlp(args: ModelArgs, layer_index: int) -> nn.Module:
    """gpt-oss's block (every layer is sparse)."""
    return TopKSoftmaxMoE(args)
