"""Tensor parallel: every layer split across ranks by attention heads and MLP columns.

Each rank holds ``1/N`` of the query and K/V heads (rows of ``q/k/v_proj``, columns of
``o_proj``) and ``1/N`` of the MLP width (rows of ``gate/up_proj``, columns of
``down_proj``), so its decoder is the same decoder with ``N`` times fewer heads and a
narrower MLP. ``o_proj`` and ``down_proj`` then hold partial sums, added up over the ranks by
``mx.distributed.all_sum``; their biases are kept by rank 0 only. The embedding, norms and
output projection are replicated, so every rank computes the same logits and runs the same
generation loop (with the same sampling seed). Each rank caches its own K/V heads.

The sums stay inside the step's graph (no evaluation inside a projection): a decode step is
one graph with its ``2 x layers`` ``all_sum``s, evaluated by the loop's one host read, and the
watchdog guards each step as a whole (``runner.stream_distributed``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from mlxformer.errors import MlxformerError
from mlxformer.formats.checkpoint import Checkpoint
from mlxformer.loader import apply_dtype_policy, loaded_model
from mlxformer.models.config import ModelArgs
from mlxformer.models.decoder import Model

ROW_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
COLUMN_SPLIT = ("o_proj", "down_proj")


class RankSummed:
    """Mixin for a linear layer holding a slice of its input columns: the outputs of all
    ranks are summed (``all_sum``), giving every rank the full projection."""

    group: mx.distributed.Group

    def __call__(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(super().__call__(x), group=self.group)  # type: ignore[misc]


class RankSummedLinear(RankSummed, nn.Linear):
    """``nn.Linear`` over this rank's input columns, summed over the ranks."""


class RankSummedQuantizedLinear(RankSummed, nn.QuantizedLinear):
    """``nn.QuantizedLinear`` over this rank's input columns, summed over the ranks."""


SUMMED_CLASS = {nn.Linear: RankSummedLinear, nn.QuantizedLinear: RankSummedQuantizedLinear}


def check_divisible(args: ModelArgs, size: int) -> None:
    """Raise, suggesting pipeline parallel, when heads or MLP width do not split over ``size`` ranks
    (or the model routes experts, which tensor parallel does not split)."""
    if args.num_experts:
        raise MlxformerError("tensor parallel does not split mixture-of-experts blocks; use --parallel pipeline, "
                             "which splits layers instead")
    unsplit = [what for what, present in (
        ("a fused qkv_proj", args.fused_qkv), ("a fused gate_up_proj", args.fused_gate_up),
        ("q/k norms over the whole projection", args.qk_norm and args.qk_norm_scope == "projection"),
        ("Gated DeltaNet layers", bool(args.linear_num_value_heads)),
    ) if present]
    if unsplit:  # their rows are not grouped by head (fused), their norm spans every head, or a recurrent state
        raise MlxformerError(f"tensor parallel does not split {' and '.join(unsplit)} by heads ({args.model_type}); "
                             "use --parallel pipeline, which splits layers instead")
    counts = {
        "attention heads": args.num_attention_heads, "KV heads": args.num_key_value_heads,
        "MLP width": args.intermediate_size,
    }
    bad = [f"{count} {what}" for what, count in counts.items() if count % size]
    if bad:
        raise MlxformerError(
            f"tensor parallel needs the heads and MLP width to divide by the {size} ranks, but the model has "
            f"{', '.join(bad)}; use --parallel pipeline, which splits layers instead"
        )


# ``piece(name, full_array)``: the part of a tensor this rank keeps.
Piece = Callable[[str, mx.array], mx.array]


def slice_for(rank: int, size: int) -> Piece:
    """What rank ``rank`` keeps of each checkpoint tensor."""

    def piece(name: str, array: mx.array) -> mx.array:
        module, _, leaf = name.rpartition(".")
        projection = module.rpartition(".")[2]
        if projection in ROW_SPLIT:  # weight, bias, scales, biases: output rows on axis 0
            rows = array.shape[0] // size
            return array[rank * rows : (rank + 1) * rows]
        if projection in COLUMN_SPLIT:
            if leaf == "bias":  # added once, after the sum
                return array if rank == 0 else mx.zeros_like(array)
            if array.shape[-1] % size:
                raise MlxformerError(
                    f"tensor {name!r} ({array.shape[-1]} packed columns) does not split into {size} whole "
                    "quantization groups; use --parallel pipeline"
                )
            cols = array.shape[-1] // size
            return array[..., rank * cols : (rank + 1) * cols]
        return array

    return piece


def local_args(args: ModelArgs, size: int) -> ModelArgs:
    """The args of one rank's narrower decoder: its share of the heads and the MLP's width."""
    return dataclasses.replace(args, num_attention_heads=args.num_attention_heads // size,
                               num_key_value_heads=args.num_key_value_heads // size,
                               intermediate_size=args.intermediate_size // size)


def load_tensor_shard(checkpoint: Checkpoint, group: mx.distributed.Group, dtype: mx.Dtype | None = None) -> Model:
    """This rank's shard of every layer, reading only its slices of the weights."""
    args, size = checkpoint.args, group.size()
    check_divisible(args, size)
    weights = checkpoint.read(checkpoint.weights, slice_for(group.rank(), size))
    model = loaded_model(local_args(args, size), weights, checkpoint.quantization)
    apply_dtype_policy(model, dtype)
    for layer in model.layers:
        for owner, name in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            projection = owner[name]
            projection.__class__ = SUMMED_CLASS[type(projection)]
            projection.group = group
    return model
