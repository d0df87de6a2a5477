"""Mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) for the one decoder.

A router picks ``num_experts_per_tok`` experts per token (softmax, top-k, optionally
renormalised); the routed experts are stacked ``(experts, out, in)`` matrices applied with
``mx.gather_mm`` / ``mx.gather_qmm`` (no Python loop over experts). For prefill-sized inputs
the (token, expert) pairs are sorted by expert first, so each expert's rows are contiguous.
Qwen2-MoE adds a shared expert behind a sigmoid gate. Parameter names are mlx-lm's
(``switch_mlp.{gate,up,down}_proj``), so mlx-community dirs load as they are; HF checkpoints'
per-expert matrices are stacked at load (``formats.expert_layouts``: lazily, by the checkpoint reader).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import mlx.core as mx
import mlx.nn as nn

from mlxformer.models.config import ModelArgs
from mlxformer.models.mlp import GATES, MLP
from mlxformer.models.router import GroupedRouter

# Below this many (token, expert) pairs the gather runs unsorted (decode steps).
SORT_THRESHOLD = 64


def _expert_bias(out: mx.array, indices: mx.array, arrays: Mapping[str, mx.array]) -> mx.array:
    """``out`` plus each chosen expert's ``bias`` ``(experts, out)`` when ``arrays`` has one (gpt-oss)."""
    if "bias" not in arrays:
        return out
    return out + mx.expand_dims(arrays["bias"][indices], -2)  # (..., out) -> (..., 1, out)


class SwitchLinear(nn.Module):
    """``experts`` stacked linear maps: weight ``(experts, out, in)``, optional bias ``(experts, out)``."""

    def __init__(self, in_dims: int, out_dims: int, experts: int, bias: bool = False):
        super().__init__()
        scale = math.sqrt(1.0 / in_dims)
        self.weight = mx.random.uniform(-scale, scale, (experts, out_dims, in_dims))
        if bias:
            self.bias = mx.zeros((experts, out_dims))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        # x (..., 1, in) gathered with indices (...) -> (..., 1, out)
        return self.gather(x, indices, sorted_indices, self)

    @staticmethod
    def gather(x: mx.array, indices: mx.array, sorted_indices: bool, arrays: Mapping[str, mx.array],
               stream: mx.Stream | None = None) -> mx.array:
        """The experts' maps over ``arrays`` (this layer's, or a row shard's views of them)."""
        out = mx.gather_mm(x, arrays["weight"].swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices,
                           stream=stream)
        return _expert_bias(out, indices, arrays)

    def to_quantized(self, group_size: int | None = None, bits: int | None = None, mode: str = "affine",
                     quantize_input: bool = False) -> "QuantizedSwitchLinear":
        """The same maps quantized per expert (``nn.quantize`` calls this)."""
        return QuantizedSwitchLinear.from_weight(self.weight, group_size or 64, bits or 4, mode, self.get("bias"))


class QuantizedSwitchLinear(nn.Module):
    """Quantized ``SwitchLinear``: packed weight, scales and biases per expert (mlx-lm's layout)."""

    def __init__(self, in_dims: int, out_dims: int, experts: int, group_size: int = 64, bits: int = 4,
                 mode: str = "affine"):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self._set_packed(mx.zeros((experts, out_dims, in_dims)))

    def _set_packed(self, weight: mx.array) -> None:
        # affine: packed weight, scales, biases; the float-scaled modes (mxfp4...) have no biases
        packed = mx.quantize(weight, group_size=self.group_size, bits=self.bits, mode=self.mode)
        self.weight, self.scales = packed[0], packed[1]
        if len(packed) > 2:
            self.biases = packed[2]

    @classmethod
    def from_weight(cls, weight: mx.array, group_size: int, bits: int, mode: str,
                    bias: mx.array | None = None) -> "QuantizedSwitchLinear":
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.group_size, layer.bits, layer.mode = group_size, bits, mode
        layer._set_packed(weight)
        if bias is not None:
            layer.bias = bias
        return layer

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return self.gather(x, indices, sorted_indices, self)

    def gather(self, x: mx.array, indices: mx.array, sorted_indices: bool, arrays: Mapping[str, mx.array],
               stream: mx.Stream | None = None) -> mx.array:
        """The experts' maps over ``arrays`` (this layer's, or a row shard's views of them)."""
        out = mx.gather_qmm(x, arrays["weight"], arrays["scales"], arrays.get("biases"), rhs_indices=indices,
                            transpose=True, group_size=self.group_size, bits=self.bits, mode=self.mode,
                            sorted_indices=sorted_indices, stream=stream)
        return _expert_bias(out, indices, arrays)


class SwitchGLU(nn.Module):
    """The gated MLP of every expert at once: ``down(act(gate(x)) * up(x))`` per chosen expert."""

    def __init__(self, hidden: int, intermediate: int, experts: int, activation: str, bias: bool = False):
        super().__init__()
        self.gate_proj = SwitchLinear(hidden, intermediate, experts, bias)
        self.up_proj = SwitchLinear(hidden, intermediate, experts, bias)
        self.down_proj = SwitchLinear(intermediate, hidden, experts, bias)
        self.activation = activation

    def __call__(self, x: mx.array, indices: mx.array, decoding: bool = False) -> mx.array:
        """``x (N, hidden)`` and expert ``indices (N, k)`` -> ``(N, k, hidden)``. ``decoding``:
        the rows are a decode step's, one token per sequence (see ``sorted_glu``)."""
        N, k = indices.shape
        if N * k < SORT_THRESHOLD:
            rows = x[:, None, None, :]  # (N, 1, 1, hidden): broadcast over the k choices
            return self.glu(rows, indices, False).squeeze(-2)  # (N, k, 1, hidden) -> (N, k, hidden)
        # sort (token, expert) pairs by expert: each expert's rows are contiguous
        pairs = indices.flatten()  # (N * k,)
        order = mx.argsort(pairs)
        rows = x[order // k][:, None, :]  # (N * k, 1, hidden)
        out = self.sorted_glu(rows, pairs[order], decoding)  # (N * k, 1, hidden)
        return out[mx.argsort(order)].reshape(N, k, -1)  # back to (token, choice) order

    def glu(self, rows: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
        """The gathered experts' ``down(act(gate(rows)) * up(rows))``."""
        gate, up = self.gate_proj(rows, indices, sorted_indices), self.up_proj(rows, indices, sorted_indices)
        return self.down_proj(GATES[self.activation](gate, up), indices, sorted_indices)

    def sorted_glu(self, rows: mx.array, indices: mx.array, decoding: bool) -> mx.array:
        """Expert-sorted pairs ``rows (P, 1, hidden)``, ``indices (P,)`` -> ``(P, 1, hidden)``:
        the gather with ``sorted_indices`` (never a host read). The CPU streams' class
        (``row_sharding.ShardedSwitchGLU``) may count a prompt's pairs per expert instead,
        never a decode step's."""
        return self.glu(rows, indices, True)


class SparseMoE(nn.Module):
    """Router + routed experts (+ Qwen2-MoE's gated shared expert, or DeepSeek's ungated
    ``shared_experts``): ``(B, T, h) -> (B, T, h)``. The router is a softmax top-k over an
    ``nn.Linear`` gate, or ``models.router.GroupedRouter`` (``args.router``)."""

    experts_name = "switch_mlp"  # the routed experts' attribute, as the checkpoint names it

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.router = args.router  # a name: kept out of the parameter tree
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False) if args.router == "softmax" else (
            GroupedRouter(args))
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts, args.hidden_act)
        if args.shared_expert_intermediate_size:
            self.shared_expert = MLP(dataclasses.replace(args, intermediate_size=args.shared_expert_intermediate_size))
            self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)
        if args.n_shared_experts:
            shared = args.moe_intermediate_size * args.n_shared_experts
            self.shared_experts = MLP(dataclasses.replace(args, intermediate_size=shared))

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Expert indices ``(N, k)`` and their weights ``(N, k)`` (float32) for rows ``x (N, h)``."""
        if self.router != "softmax":
            return self.gate(x)
        probs = mx.softmax(self.gate(x).astype(mx.float32), axis=-1)  # (N, experts)
        indices = mx.argpartition(-probs, kth=self.top_k - 1, axis=-1)[:, : self.top_k]
        weights = mx.take_along_axis(probs, indices, axis=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return mx.stop_gradient(indices), weights

    def __call__(self, x: mx.array) -> mx.array:
        B, T, H = x.shape
        rows = x.reshape(B * T, H)  # (B, T, h) -> (N, h)
        indices, weights = self.route(rows)
        routed = self[self.experts_name](rows, indices, decoding=T == 1)  # (N, k, h)
        y = (routed * weights[..., None].astype(routed.dtype)).sum(axis=1)  # (N, h)
        if "shared_expert" in self:
            y = y + mx.sigmoid(self.shared_expert_gate(rows)) * self.shared_expert(rows)
        if "shared_experts" in self:
            y = y + self.shared_experts(rows)
        return y.reshape(B, T, H)


def moe_mlp(args: ModelArgs, layer_index: int) -> nn.Module:
    """A sparse block, or the dense MLP on ``mlp_only_layers`` and between sparse steps."""
    sparse = layer_index not in args.mlp_only_layers and (layer_index + 1) % args.decoder_sparse_step == 0
    return SparseMoE(args) if sparse else MLP(args)
