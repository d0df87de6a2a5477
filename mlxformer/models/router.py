"""The DeepSeek-style expert router (DeepSeek-V2/V3, GLM-4.5/4.6, GLM-4.7-Flash), one component.

Scores are the softmax (DeepSeek-V2) or the sigmoid (``noaux_tc``: V3, GLM) of the router logits,
computed in float32. The experts are split into ``n_group`` groups; only the ``topk_group`` best
groups compete for the ``top_k`` choices: a group's score is its best expert (V2's
``group_limited_greedy``) or the sum of its best two after adding ``e_score_correction_bias``
(``noaux_tc``, where the bias only steers the choice, never the weights). ``greedy`` picks from
every expert. The chosen weights are renormalised (``norm_topk_prob``) and scaled by
``routed_scaling_factor``. Parameter names are the checkpoint's (``mlp.gate.weight``,
``mlp.gate.e_score_correction_bias``).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxformer.models.config import ModelArgs

# topk_method -> the score function it uses
TOPK_METHODS = {"greedy": "softmax", "group_limited_greedy": "softmax", "noaux_tc": "sigmoid"}


class GroupedRouter(nn.Module):
    """``route(x (N, hidden)) -> (indices (N, k), weights (N, k) float32)``."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.method = args.router
        self.top_k, self.n_group, self.topk_group = args.num_experts_per_tok, args.n_group, args.topk_group
        self.norm_topk_prob, self.scaling = args.norm_topk_prob, args.routed_scaling_factor
        self.weight = mx.zeros((args.num_experts, args.hidden_size))
        if self.method == "noaux_tc":
            self.e_score_correction_bias = mx.zeros((args.num_experts,))

    def _group_mask(self, choice: mx.array) -> mx.array:
        """Which experts ``(N, experts)`` lie in each row's ``topk_group`` best groups."""
        N, E = choice.shape
        grouped = choice.reshape(N, self.n_group, E // self.n_group)  # (N, groups, per group)
        if self.method == "noaux_tc":
            group_scores = mx.topk(grouped, 2, axis=-1).sum(axis=-1)  # (N, groups)
        else:
            group_scores = grouped.max(axis=-1)
        best = mx.argpartition(-group_scores, kth=self.topk_group - 1, axis=-1)[:, : self.topk_group]
        chosen = mx.put_along_axis(mx.zeros_like(group_scores), best, mx.array(1.0), axis=-1) > 0  # (N, groups)
        return mx.repeat(chosen[:, :, None], E // self.n_group, axis=2).reshape(N, E)

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        logits = x.astype(mx.float32) @ self.weight.astype(mx.float32).T  # (N, experts)
        scores = mx.sigmoid(logits) if TOPK_METHODS[self.method] == "sigmoid" else mx.softmax(logits, axis=-1)
        choice = scores
        if self.method == "noaux_tc":
            choice = scores + self.e_score_correction_bias.astype(mx.float32)
        if self.method != "greedy" and self.n_group > 1:
            fill = -mx.inf if self.method == "noaux_tc" else 0.0
            choice = mx.where(self._group_mask(choice), choice, mx.array(fill, mx.float32))
        indices = mx.stop_gradient(mx.argpartition(-choice, kth=self.top_k - 1, axis=-1)[:, : self.top_k])
        weights = mx.take_along_axis(scores, indices, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return indices, weights * self.scaling
