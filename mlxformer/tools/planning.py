"""What a model needs, from its config and tensor headers only (never the weights): exact and
estimated parameter counts, weight memory per dtype/quantization, KV-cache bytes, and how
many machines a pipeline needs. Behind ``mlxformer info``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxformer.cache.state import state_nbytes
from mlxformer.formats.checkpoint import Checkpoint, open_checkpoint
from mlxformer.loader import checked_model
from mlxformer.models.config import ModelArgs
from mlxformer.models.dtype_policy import (
    DtypePlan, cast_floating, decide_dtype, float16_safe, floating_dtypes, is_quantized,
)
from mlxformer.models.moe import QuantizedSwitchLinear

# Weight quantizations reported (bits; MLX affine, groups of 64 with 16-bit scales and biases).
WEIGHT_BITS = (8, 6, 4)
WEIGHT_GROUP_SIZE = 64
KV_BITS = (8, 4)
KV_GROUP_SIZE = 64  # CacheSettings' default
KV_STEP = 256  # KVCache grows its buffers this many tokens at a time
# Share of a machine's memory a model may use (macOS lets the GPU wire about 75% by default).
USABLE_MEMORY_SHARE = 0.75


@dataclass(frozen=True)
class WeightEntry:
    """One decoder weight (a matrix with its scales and biases, or another parameter)."""

    name: str  # HF name
    shape: tuple[int, ...]  # logical shape (unpacked)
    stored_bytes: int  # bytes as the checkpoint stores it (quantized: packed + scales + biases)
    loaded_bytes: int  # bytes once loaded with the compute dtype policy applied


@dataclass(frozen=True)
class Footprint:
    """A model's sizes, read from its headers."""

    args: ModelArgs
    tensors: list[WeightEntry]
    quantized: bool
    plan: DtypePlan  # the compute dtype ``load`` picks on the device planned for

    @property
    def parameters(self) -> int:
        """Exact number of weights (quantized ones counted unpacked, tied embeddings once)."""
        return sum(math.prod(t.shape) for t in self.tensors)

    @property
    def active_parameters(self) -> int:
        """Weights one token computes with: a mixture-of-experts model's routed experts count
        ``num_experts_per_tok / num_experts`` of theirs (equal to ``parameters`` for dense models)."""
        a = self.args
        routed = sum(math.prod(t.shape) for t in self.tensors if ".switch_mlp." in t.name or ".mlp.experts." in t.name)
        if not routed:
            return self.parameters
        return self.parameters - routed + routed * a.num_experts_per_tok // a.num_experts

    @property
    def estimate(self) -> int:
        """The LLaMA formula ``12·L·d²`` plus the embedding (and an untied output projection)."""
        a = self.args
        embedding = a.vocab_size * a.hidden_size * (1 if a.tie_word_embeddings else 2)
        return 12 * a.num_hidden_layers * a.hidden_size**2 + embedding

    @property
    def stored_bytes(self) -> int:
        """Weight bytes of this checkpoint as stored."""
        return sum(t.stored_bytes for t in self.tensors)

    @property
    def loaded_bytes(self) -> int:
        """Weight bytes once loaded on the device planned for (the dtype policy applied)."""
        return sum(t.loaded_bytes for t in self.tensors)

    def weight_bytes(self, bits: int) -> int:
        """Weight bytes at ``bits`` (32, 16 for float; 8, 6, 4 for affine quantization of the matrices)."""
        if bits >= 16:
            return self.parameters * bits // 8
        total = 0
        for t in self.tensors:
            size = math.prod(t.shape)
            if len(t.shape) >= 2 and t.shape[-1] % WEIGHT_GROUP_SIZE == 0:  # matrices, stacked experts too
                total += size * bits // 8 + size // WEIGHT_GROUP_SIZE * 4  # + 16-bit scale and bias per group
            else:
                total += size * 2  # norms stay 16-bit
        return total

    @property
    def activation_bytes(self) -> int:
        """Bytes per element of activations (and so of a float KV cache): the compute dtype's."""
        return self.plan.compute.size

    def kv_bytes(self, tokens: int, bits: int | None = None, group_size: int = KV_GROUP_SIZE) -> int:
        """Bytes of filled caches holding ``tokens`` (a growing layer's buffers grow ``KV_STEP`` at
        a time, a sliding-window layer's hold its window): float, or ``bits``-quantized in groups
        of ``group_size`` with scales and biases."""
        capacity = -(-tokens // KV_STEP) * KV_STEP
        a = self.args
        recurrent = sum(a.layer_is_linear(i) for i in range(a.num_hidden_layers))  # fixed-size states
        states = recurrent * state_nbytes(a, 1, self.plan.compute) if tokens else 0
        return states + sum(self._layer_bytes(i, bits, group_size) * min(capacity, a.layer_window(i) or capacity)
                            for i in self._attention_layers())

    def kv_bytes_per_token(self, bits: int | None = None, group_size: int = KV_GROUP_SIZE) -> int:
        """KV-cache bytes per token over the attention layers (keys and values), in the activation dtype."""
        return sum(self._layer_bytes(i, bits, group_size) for i in self._attention_layers())

    def _attention_layers(self) -> list[int]:
        """The layers with keys and values of their own (Gemma 4's last layers read others')."""
        cached = self.args.num_hidden_layers - self.args.num_kv_shared_layers
        return [i for i in range(cached) if not self.args.layer_is_linear(i)]

    def _layer_bytes(self, index: int, bits: int | None, group_size: int) -> int:
        """One token's keys and values in layer ``index``: float, or packed codes plus one scale
        and one bias per group."""
        element_bytes = self.activation_bytes

        def row_bytes(dims: int) -> int:
            return dims * element_bytes if bits is None else dims * bits // 8 + 2 * (dims // group_size) * element_bytes

        heads, key_dims, value_dims = self.args.cache_dims(index)  # MLA: one rope key and one latent
        return heads * (row_bytes(key_dims) + row_bytes(value_dims))


def footprint(path_or_repo: str | Path | Checkpoint, device: mx.DeviceType | None = None) -> Footprint:
    """The footprint of a local HF/MLX dir, hub repo id or ``.gguf`` file, from headers only,
    as ``load`` would place it on ``device`` (default: MLX's default device)."""
    checkpoint = path_or_repo if isinstance(path_or_repo, Checkpoint) else open_checkpoint(path_or_repo)
    tensors = checkpoint.weights
    model = checked_model(checkpoint.args, tensors, checkpoint.quantization)
    # Placeholders of the stored shapes and dtypes (lazy: never allocated), cast by the policy.
    model.load_weights([(n, mx.zeros(e.shape, e.dtype)) for n, e in tensors.entries.items()], strict=True)
    stored = dict(tree_flatten(model.parameters()))
    plan = decide_dtype(device or mx.default_device().type, floating_dtypes(model), is_quantized(model), None,
                        float16_safe(checkpoint.args.model_type))
    cast_floating(model, plan.compute, plan.keep_quantized_linear_scales)
    loaded = dict(tree_flatten(model.parameters()))
    entries = []
    for path, module in model.named_modules():
        # its own parameters: not the private arrays (``_``-named: LongRoPE's factor tables)
        names = [name for k, v in module.items() if isinstance(v, mx.array) and (name := f"{path}.{k}") in stored]
        if not names:
            continue
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)):
            *lead, packed = module.weight.shape  # (out, packed) or (experts, out, packed)
            packed_parts = [n for n in names if n.rsplit(".", 1)[1] in ("weight", "scales", "biases")]
            units = [(f"{path}.weight", (*lead, packed * 32 // module.bits), packed_parts)]
            units += [(n, tuple(stored[n].shape), [n]) for n in names if n not in packed_parts]  # its bias
        else:
            units = [(name, tuple(stored[name].shape), [name]) for name in names]
        for name, shape, parts in units:
            entries.append(WeightEntry(name, shape, sum(stored[p].nbytes for p in parts),
                                       sum(loaded[p].nbytes for p in parts)))
    return Footprint(checkpoint.args, sorted(entries, key=lambda e: e.name), is_quantized(model), plan)


def machine_memory() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def ranks_needed(needed_bytes: int, memory_bytes: int) -> int:
    """Machines of ``memory_bytes`` a pipeline needs for ``needed_bytes`` (1 if it fits)."""
    return max(1, math.ceil(needed_bytes / (memory_bytes * USABLE_MEMORY_SHARE)))
