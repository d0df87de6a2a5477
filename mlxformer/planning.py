"""What a model needs, from its config and tensor headers only (never the weights): exact and
estimated parameter counts, weight memory per dtype/quantization, KV-cache bytes, and how
many machines a pipeline needs. Behind ``mlxformer info``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxformer.errors import MlxformerError
from mlxformer.formats.gguf import _hf_name, _quantization_config, config_from_metadata, loaded_nbytes
from mlxformer.formats.gguf_header import read_gguf_header
from mlxformer.formats.hub import resolve_source
from mlxformer.formats.safetensors import _DTYPE_BYTES, read_config, read_safetensors_header, safetensors_files
from mlxformer.models.config import ModelArgs

# Weight quantizations reported (bits; MLX affine, groups of 64 with 16-bit scales and biases).
WEIGHT_BITS = (8, 6, 4)
WEIGHT_GROUP_SIZE = 64
KV_BITS = (8, 4)
KV_GROUP_SIZE = 64  # CacheSettings' default
KV_STEP = 256  # KVCache grows its buffers this many tokens at a time
# Share of a machine's memory a model may use (macOS lets the GPU wire about 75% by default).
USABLE_MEMORY_SHARE = 0.75


@dataclass(frozen=True)
class TensorEntry:
    """One decoder weight as the headers describe it."""

    name: str  # HF name
    shape: tuple[int, ...]  # logical shape (unpacked)
    loaded_bytes: int  # bytes it takes in MLX as stored (quantized: packed + scales + biases)


@dataclass(frozen=True)
class Footprint:
    """A model's sizes, read from its headers."""

    args: ModelArgs
    tensors: list[TensorEntry]
    quantized: bool
    float_bytes: int  # bytes per element of the checkpoint's float tensors

    @property
    def parameters(self) -> int:
        """Exact number of weights (quantized ones counted unpacked, tied embeddings once)."""
        return sum(math.prod(t.shape) for t in self.tensors)

    @property
    def estimate(self) -> int:
        """The LLaMA formula ``12·L·d²`` plus the embedding (and an untied output projection)."""
        a = self.args
        embedding = a.vocab_size * a.hidden_size * (1 if a.tie_word_embeddings else 2)
        return 12 * a.num_hidden_layers * a.hidden_size**2 + embedding

    @property
    def loaded_bytes(self) -> int:
        """Weight bytes of this checkpoint as stored."""
        return sum(t.loaded_bytes for t in self.tensors)

    def weight_bytes(self, bits: int) -> int:
        """Weight bytes at ``bits`` (32, 16 for float; 8, 6, 4 for affine quantization of the matrices)."""
        if bits >= 16:
            return self.parameters * bits // 8
        total = 0
        for t in self.tensors:
            size = math.prod(t.shape)
            if len(t.shape) == 2 and t.shape[-1] % WEIGHT_GROUP_SIZE == 0:
                total += size * bits // 8 + size // WEIGHT_GROUP_SIZE * 4  # + 16-bit scale and bias per group
            else:
                total += size * 2  # norms stay 16-bit
        return total

    @property
    def activation_bytes(self) -> int:
        """Bytes per element of activations (and so of a float KV cache) on this device:
        float32 for quantized models on the CPU (the load policy), else the checkpoint's."""
        from mlxformer.device import on_cpu

        return 4 if self.quantized and on_cpu() else self.float_bytes

    def kv_bytes(self, tokens: int, bits: int | None = None, group_size: int = KV_GROUP_SIZE) -> int:
        """Bytes of a filled ``KVCache`` holding ``tokens`` (buffers grow ``KV_STEP`` at a time):
        float, or ``bits``-quantized in groups of ``group_size`` with scales and biases."""
        capacity = -(-tokens // KV_STEP) * KV_STEP
        return self.kv_bytes_per_token(bits, group_size) * capacity

    def kv_bytes_per_token(self, bits: int | None = None, group_size: int = KV_GROUP_SIZE) -> int:
        """KV-cache bytes per token over all layers (keys and values), in the activation dtype."""
        element_bytes = self.activation_bytes
        a = self.args
        if bits is None:
            per_head = a.head_dim * element_bytes
        else:  # packed codes plus one scale and one bias per group
            per_head = a.head_dim * bits // 8 + 2 * (a.head_dim // group_size) * element_bytes
        return 2 * a.num_hidden_layers * a.num_key_value_heads * per_head


def footprint(path_or_repo: str | Path) -> Footprint:
    """The footprint of a local HF/MLX dir, hub repo id or ``.gguf`` file, from headers only."""
    source = resolve_source(path_or_repo)
    if source.is_file():
        if source.suffix.lower() != ".gguf":
            raise MlxformerError(f"{source}: not a model dir or .gguf file")
        return _gguf_footprint(source)
    return _safetensors_footprint(source)


def _gguf_footprint(path: Path) -> Footprint:
    header = read_gguf_header(path)
    config = config_from_metadata(header.metadata, {t.name for t in header.tensors})
    types = {t.name: t.type_name for t in header.tensors}
    arch = str(header.metadata.get("general.architecture"))
    entries, float_bytes = [], 4
    for t in header.tensors:
        if t.name == "rope_freqs.weight":  # rope frequency factors: config, not a weight
            continue
        loaded = loaded_nbytes(t.type_name, t.size)  # MLX triplet: packed codes + scale, bias per group
        if loaded is None:
            loaded = t.nbytes
            if len(t.shape) == 2:
                float_bytes = t.nbytes // max(t.size, 1)
        entries.append(TensorEntry(_hf_name(t.name, arch), t.shape, loaded))
    return Footprint(ModelArgs.from_dict(config), entries, bool(_quantization_config(types, arch)), float_bytes)


def _safetensors_footprint(directory: Path) -> Footprint:
    config = read_config(directory)
    args = ModelArgs.from_dict(config)
    header: dict[str, Any] = {}
    for file in safetensors_files(directory):
        header.update(read_safetensors_header(file))
    quantization = config.get("quantization") or config.get("quantization_config") or {}
    skip = {"lm_head.weight", "lm_head.scales", "lm_head.biases"} if args.tie_word_embeddings else set()
    entries, float_bytes = [], 4
    names = sorted(name for name in header if "rotary_emb.inv_freq" not in name and name not in skip)
    for name in names:
        module, _, leaf = name.rpartition(".")
        if leaf in ("scales", "biases") and f"{module}.weight" in header:
            continue
        info = header[name]
        shape = tuple(info["shape"])
        loaded = math.prod(shape) * _DTYPE_BYTES[info["dtype"]]
        if f"{module}.scales" in header and leaf == "weight":
            override = quantization.get(module)
            bits = int(override["bits"]) if isinstance(override, dict) else int(quantization.get("bits", 4))
            shape = (*shape[:-1], shape[-1] * 32 // bits)
            for companion in ("scales", "biases"):
                if f"{module}.{companion}" in header:
                    loaded += math.prod(header[f"{module}.{companion}"]["shape"]) * _DTYPE_BYTES[
                        header[f"{module}.{companion}"]["dtype"]
                    ]
        elif len(shape) == 2:
            float_bytes = _DTYPE_BYTES[info["dtype"]]
        entries.append(TensorEntry(name, shape, loaded))
    return Footprint(args, entries, bool(quantization), float_bytes)


def machine_memory() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def ranks_needed(needed_bytes: int, memory_bytes: int) -> int:
    """Machines of ``memory_bytes`` a pipeline needs for ``needed_bytes`` (1 if it fits)."""
    return max(1, math.ceil(needed_bytes / (memory_bytes * USABLE_MEMORY_SHARE)))
