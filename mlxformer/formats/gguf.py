"""Read llama-architecture GGUF files into an HF-style config and HF-named MLX weights.

``mx.load`` decodes the tensors: Q4_0, Q4_1 and Q8_0 arrive as MLX affine-quantized
triplets (``weight``/``scales``/``biases``, group 32) and are kept packed as they are.
This module checks the file first (its own header walk gives every tensor's type), maps
llama.cpp names to HF names through one table, and undoes llama.cpp's Q/K row permutation.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxformer.errors import MlxformerError
from mlxformer.formats.gguf_header import read_gguf_header

FLOAT_TYPES = ("F32", "F16", "BF16")
QUANT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}  # all with 32-weight groups
GGUF_GROUP_SIZE = 32
SUPPORTED_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# llama.cpp tensor name -> HF name; {i} is the layer index.
TENSOR_NAME_MAP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "blk.{i}.ffn_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj",
    "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
    "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj",
    "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
    "blk.{i}.attn_q_norm": "model.layers.{i}.self_attn.q_norm",
    "blk.{i}.attn_k_norm": "model.layers.{i}.self_attn.k_norm",
    "blk.{i}.ffn_gate": "model.layers.{i}.mlp.gate_proj",
    "blk.{i}.ffn_up": "model.layers.{i}.mlp.up_proj",
    "blk.{i}.ffn_down": "model.layers.{i}.mlp.down_proj",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


def read_tensor_types(path: Path) -> dict[str, str]:
    """GGUF tensor name -> ggml type name, from the file's header; raises on a bad header."""
    return {tensor.name: tensor.type_name for tensor in read_gguf_header(path).tensors}


def _meta(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    value = metadata.get(key, default)
    if isinstance(value, mx.array):
        if value.ndim:
            return value.tolist()
        if value.dtype == mx.float32:  # shortest decimal that round-trips, e.g. 1e-05 not 9.9999997e-06
            return float(str(np.float32(value.item())))
        return value.item()
    return value


def config_from_metadata(metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """An HF ``config.json`` dict from GGUF metadata (as returned by ``mx.load``)."""
    arch = _meta(metadata, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise MlxformerError(f"unsupported GGUF architecture {arch!r} (supported: llama, qwen2, qwen3)")

    def field(name: str, default: Any = None) -> Any:
        value = _meta(metadata, f"{arch}.{name}", default)
        if value is None:
            raise MlxformerError(f"GGUF metadata is missing {arch}.{name}")
        return value

    hidden = int(field("embedding_length"))
    heads = int(field("attention.head_count"))
    vocab = _meta(metadata, f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", []))
    config: dict[str, Any] = {
        "model_type": SUPPORTED_ARCHITECTURES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(field("block_count")),
        "intermediate_size": int(field("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field("attention.head_count_kv", heads)),
        "head_dim": int(field("attention.key_length", hidden // heads)),
        "vocab_size": int(vocab),
        "rms_norm_eps": float(field("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(field("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    scaling_type = _meta(metadata, f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise MlxformerError(f"unsupported GGUF rope scaling type {scaling_type!r}")
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(field("rope.scaling.factor"))}
    if arch == "qwen2":
        config["attention_bias"] = True
    return config


def _hf_name(gguf_name: str) -> str:
    """Map ``blk.3.attn_q.weight`` to ``model.layers.3.self_attn.q_proj.weight``; unknown names raise."""
    stem, _, suffix = gguf_name.rpartition(".")
    layer = _LAYER_NAME.match(stem)
    pattern, index = (f"blk.{{i}}.{layer.group(2)}", layer.group(1)) if layer else (stem, None)
    if pattern not in TENSOR_NAME_MAP:
        raise MlxformerError(f"GGUF tensor {gguf_name!r} has no mapping to this decoder")
    return TENSOR_NAME_MAP[pattern].format(i=index) + "." + suffix


def _unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row order (interleaved rotary pairs) back to HF's half-split order."""
    rows = w.shape[0]
    # (heads, head_dim/2, 2, ...) -> (heads, 2, head_dim/2, ...)
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: Path) -> tuple[dict[str, Any], dict[str, mx.array], dict[str, Any]]:
    """Read a GGUF file: ``(config with quantization, HF-named weights, raw metadata)``."""
    types = read_tensor_types(path)
    bad = {name: t for name, t in types.items() if t not in FLOAT_TYPES and t not in QUANT_BITS}
    if bad:
        name, type_name = next(iter(bad.items()))
        raise MlxformerError(
            f"{path}: tensor {name!r} has GGUF type {type_name}, which is not supported "
            f"(supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0)"
        )
    try:
        raw, metadata = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as exc:
        raise MlxformerError(f"{path}: cannot read GGUF file: {str(exc).splitlines()[0]}") from None
    config = config_from_metadata(metadata, set(types))
    permute = config["model_type"] == "llama"  # llama.cpp permutes Q/K only for the llama architecture
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    weights: dict[str, mx.array] = {}
    for gguf_name, array in raw.items():
        name = _hf_name(gguf_name)
        proj = name.split(".")[-2]
        if permute and proj in heads and name.split(".")[-1] in ("weight", "scales", "biases", "bias"):
            array = _unpermute_rows(array, heads[proj])
        weights[name] = array
    config["quantization"] = _quantization_config(types)
    if not config["quantization"]:
        del config["quantization"]
    return config, weights, metadata


def _quantization_config(types: dict[str, str]) -> dict[str, Any]:
    """mlx-lm style ``quantization`` entry: the most common bits as default, others per layer."""
    module_bits = {_hf_name(n).rsplit(".", 1)[0]: QUANT_BITS[t] for n, t in types.items() if t in QUANT_BITS}
    if not module_bits:
        return {}
    bits_values = list(module_bits.values())
    default_bits = max(set(bits_values), key=bits_values.count)
    quantization: dict[str, Any] = {"group_size": GGUF_GROUP_SIZE, "bits": default_bits}
    for module, bits in sorted(module_bits.items()):
        if bits != default_bits:
            quantization[module] = {"group_size": GGUF_GROUP_SIZE, "bits": bits}
    return quantization
