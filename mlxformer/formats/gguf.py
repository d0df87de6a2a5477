"""Read llama-architecture GGUF files into an HF-style config and HF-named MLX weights.

``gguf_reader`` parses and checks the container; ``gguf_quants`` decodes the blocks. Each
tensor keeps its own type: exact types become MLX affine triplets (``weight``/``scales``/
``biases``, group 32, their own bits), Q2_K/Q3_K/Q6_K are requantized to 8 bits (see
``INEXACT_BITS``), floats stay float. The per-layer bits go into an mlx-lm style
``quantization`` config entry. Names map to HF names through one table, llama.cpp's Q/K row
permutation is undone, and ``rope_freqs`` becomes the config's rope frequency factors.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from mlxformer.errors import MlxformerError
from mlxformer.formats.gguf_quants import EXACT_TYPES, FLOAT_DECODED_TYPES, GROUP_SIZE, decode_codes, \
    decode_values, requantize
from mlxformer.formats.gguf_families import GGUF_ARCHITECTURES, NORM_SHIFTED_ARCHS, arch_config
from mlxformer.formats.gguf_reader import GGUFFile, TensorInfo, read_gguf

FLOAT_TYPES = ("F32", "F16", "BF16")
# Q2_K/Q3_K/Q6_K (16-value sub-blocks) are requantized to 8 bits, group 32: the measured
# choice (docs/design/gguf.md), a fraction of the type's own rounding error at ~1.5x its size.
INEXACT_BITS = 8
SUPPORTED_TYPES = FLOAT_TYPES + EXACT_TYPES + FLOAT_DECODED_TYPES
# Bits of the MLX layer each quantized GGUF type becomes (all with groups of 32).
QUANT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5,
              **dict.fromkeys(FLOAT_DECODED_TYPES, INEXACT_BITS)}
GGUF_GROUP_SIZE = GROUP_SIZE


def loaded_nbytes(type_name: str, size: int) -> int | None:
    """Bytes a quantized tensor of ``size`` weights takes once loaded (packed codes plus a scale and
    a bias per group: float16 for the legacy types, float32 for the K types), None for floats."""
    bits = QUANT_BITS.get(type_name)
    if bits is None:
        return None
    scale_bytes = 2 if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0") else 4
    return size * bits // 8 + size // GROUP_SIZE * 2 * scale_bytes

SUPPORTED_ARCHITECTURES = GGUF_ARCHITECTURES

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
_SANDWICH_NORMS = {
    "blk.{i}.post_attention_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.ffn_norm": "model.layers.{i}.pre_feedforward_layernorm",
    "blk.{i}.post_ffw_norm": "model.layers.{i}.post_feedforward_layernorm",
}
# Per-architecture rows, added to (or replacing) ``TENSOR_NAME_MAP``.
ARCH_TENSOR_NAMES: dict[str, dict[str, str]] = {
    "gemma2": _SANDWICH_NORMS,
    "gemma3": _SANDWICH_NORMS,
    "olmo2": {  # norms after the sublayers only
        "blk.{i}.post_attention_norm": "model.layers.{i}.post_attention_layernorm",
        "blk.{i}.post_ffw_norm": "model.layers.{i}.post_feedforward_layernorm",
    },
    "phi3": {  # fused projections, as Phi-3 checkpoints store them
        "blk.{i}.attn_qkv": "model.layers.{i}.self_attn.qkv_proj",
        "blk.{i}.ffn_up": "model.layers.{i}.mlp.gate_up_proj",
    },
}
# Architectures whose Q/K rows llama.cpp's converter permuted (its LlamaModel and subclasses).
PERMUTED_QK_ARCHS = ("llama", "granite", "smollm3")
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")

def _meta(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    value = metadata.get(key, default)
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def config_from_metadata(metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """An HF ``config.json`` dict from GGUF metadata (as returned by ``read_gguf``)."""
    arch = _meta(metadata, "general.architecture")
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
        raise MlxformerError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def field(name: str, default: Any = ...) -> Any:
        value = _meta(metadata, f"{arch}.{name}", None if default is ... else default)
        if value is None:
            if default is None:
                return None
            raise MlxformerError(f"GGUF metadata is missing {arch}.{name}")
        if not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
            raise MlxformerError(f"GGUF metadata {arch}.{name} is not a finite number: {str(value)[:50]!r}")
        return value

    hidden = int(field("embedding_length"))
    heads = int(field("attention.head_count"))
    if heads <= 0 or hidden <= 0:
        raise MlxformerError("GGUF metadata has a non-positive embedding length or head count")
    tokens = metadata.get("tokenizer.ggml.tokens", [])
    vocab = _meta(metadata, f"{arch}.vocab_size") or (len(tokens) if isinstance(tokens, (list, np.ndarray)) else 0)
    if not isinstance(vocab, int):
        raise MlxformerError(f"GGUF metadata {arch}.vocab_size is not an integer")
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
            raise MlxformerError(f"unsupported GGUF rope scaling type {str(scaling_type)[:50]!r}")
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(field("rope.scaling.factor"))}
    if arch == "qwen2":
        config["attention_bias"] = True
    config.update(arch_config(arch, field, config))
    _check_against_tensors(config, tensor_names)
    return config


def _check_against_tensors(config: dict[str, Any], tensor_names: set[str]) -> None:
    """Sizes must be positive and the layer count must be the file's: a corrupt count must not
    make the decoder build millions of layers."""
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "max_position_embeddings"):
        if not 0 < config[key] < 1 << 31:
            raise MlxformerError(f"GGUF metadata gives an invalid {key}: {config[key]}")
    layers = {int(m.group(1)) for name in tensor_names if (m := _LAYER_NAME.match(name))}
    if layers != set(range(config["num_hidden_layers"])):
        raise MlxformerError(f"GGUF metadata says {config['num_hidden_layers']} layers, but the file has "
                             f"tensors for {len(layers)} (indices up to {max(layers, default=-1)})")


def _hf_name(gguf_name: str, arch: str = "llama") -> str:
    """Map ``blk.3.attn_q.weight`` to ``model.layers.3.self_attn.q_proj.weight``; unknown names raise."""
    stem, _, suffix = gguf_name.rpartition(".")
    layer = _LAYER_NAME.match(stem)
    pattern, index = (f"blk.{{i}}.{layer.group(2)}", layer.group(1)) if layer else (stem, None)
    table = {**TENSOR_NAME_MAP, **ARCH_TENSOR_NAMES.get(arch, {})}
    if pattern not in table:
        raise MlxformerError(f"GGUF tensor {gguf_name!r} has no mapping to this decoder (architecture {arch})")
    return table[pattern].format(i=index) + "." + suffix


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order (interleaved rotary pairs) back to HF's half-split order."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise MlxformerError(f"GGUF Q/K projection with {rows} rows does not split into {n_heads} heads")
    # (heads, head_dim/2, 2, ...) -> (heads, 2, head_dim/2, ...)
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _narrowest_exact(values: np.ndarray) -> np.ndarray:
    """float16 when every value survives the round trip (legacy-type scales do), else float32."""
    half = values.astype(np.float16)
    if np.all(np.isfinite(half)) and np.array_equal(half.astype(np.float32), values):
        return half
    return values


def _float_tensor(gguf: GGUFFile, info: TensorInfo) -> mx.array:
    raw = gguf.raw(info)
    if info.type_name == "F32":
        return mx.array(raw.view(np.float32).reshape(info.shape))
    if info.type_name == "F16":
        return mx.array(raw.view(np.float16).reshape(info.shape))
    return mx.array(raw.view(np.uint16).reshape(info.shape)).view(mx.bfloat16)


def _decode(gguf: GGUFFile, info: TensorInfo, heads: int | None) -> tuple[dict[str, np.ndarray | mx.array], int]:
    """One tensor's output arrays (``weight`` or ``weight``/``scales``/``biases``) and its bits (0: float)."""
    if info.type_name not in SUPPORTED_TYPES:
        raise MlxformerError(
            f"{gguf.path}: tensor {info.name!r} has GGUF type {info.type_name}, which is not supported "
            f"(supported: {', '.join(SUPPORTED_TYPES)})"
        )
    if info.type_name in FLOAT_TYPES:
        array = _float_tensor(gguf, info)
        return {"weight": _unpermute_mx(array, heads)}, 0
    cols = info.shape[-1]
    rows = int(np.prod(info.shape[:-1]))
    raw = gguf.raw(info)
    if len(info.shape) != 2:  # a quantized vector: plain float values
        values = decode_values(raw, info.type_name, rows, cols).reshape(info.shape)
        return {"weight": _unpermute_mx(mx.array(values), heads)}, 0
    if info.type_name in EXACT_TYPES:
        codes = decode_codes(raw, info.type_name, rows, cols)
        out = {"weight": codes.packed, "scales": _narrowest_exact(codes.scales),
               "biases": _narrowest_exact(codes.biases)}
        if heads is not None:
            out = {k: _unpermute_rows(v, heads) for k, v in out.items()}
        return {k: mx.array(v) for k, v in out.items()}, codes.bits
    values = decode_values(raw, info.type_name, rows, cols)
    if heads is not None:
        values = _unpermute_rows(values, heads)
    weight, scales, biases = requantize(values, INEXACT_BITS)
    return {"weight": weight, "scales": scales, "biases": biases}, INEXACT_BITS


def _unpermute_mx(array: mx.array, heads: int | None) -> mx.array:
    if heads is None:
        return array
    if array.dtype == mx.bfloat16:
        return mx.array(_unpermute_rows(np.array(array.view(mx.uint16)), heads)).view(mx.bfloat16)
    return mx.array(_unpermute_rows(np.array(array), heads))


def load_gguf(
    path: Path,
    wanted: Callable[[str], bool] | None = None,
    piece: Callable[[str, mx.array], mx.array] | None = None,
) -> tuple[dict[str, Any], dict[str, mx.array], dict[str, Any]]:
    """Read a GGUF file: ``(config with quantization, HF-named weights, metadata)``.

    ``wanted(hf_name)`` chooses the tensors to decode (default: all; the data of the others
    is never read); ``piece(hf_name, array)`` cuts each decoded array to the part kept, one
    tensor at a time (a pipeline or tensor-parallel rank's share)."""
    gguf = read_gguf(path)
    tensors = dict(gguf.tensors)
    rope_freqs = tensors.pop("rope_freqs.weight", None)
    arch = str(_meta(gguf.metadata, "general.architecture"))
    for name, info in tensors.items():  # fail on an unknown name or type before decoding anything
        _hf_name(name, arch)
        if info.type_name not in SUPPORTED_TYPES:
            _decode(gguf, info, None)
    config = config_from_metadata(gguf.metadata, set(tensors))
    if rope_freqs is not None:
        config["rope_scaling"] = {"rope_type": "freq_factors", "factor": 1.0,
                                  "freq_factors": [float(f) for f in _rope_factors(gguf, rope_freqs)]}
    permute = arch in PERMUTED_QK_ARCHS
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    weights: dict[str, mx.array] = {}
    for gguf_name, info in tensors.items():
        name = _hf_name(gguf_name, arch)
        if wanted is not None and not wanted(name):
            continue
        module, suffix = name.rsplit(".", 1)
        proj = module.rsplit(".", 1)[-1]
        arrays, bits = _decode(gguf, info, heads.get(proj) if permute else None)
        if arch in NORM_SHIFTED_ARCHS and name.endswith("norm.weight"):
            arrays["weight"] = arrays["weight"] - 1  # the converter stored 1 + weight
        if piece is not None:
            keys = {key: f"{module}.{key}" if bits else name for key in arrays}
            arrays = {key: mx.contiguous(piece(keys[key], value)) for key, value in arrays.items()}
            mx.eval(arrays)
        if bits:
            if suffix != "weight":
                raise MlxformerError(f"{path}: tensor {gguf_name!r} is quantized but is not a weight matrix")
            weights.update({f"{module}.{key}": value for key, value in arrays.items()})
        else:
            weights[name] = arrays["weight"]
    quantization = _quantization_config({name: info.type_name for name, info in tensors.items()}, arch)
    if quantization:
        config["quantization"] = quantization
    return config, weights, gguf.metadata


def _rope_factors(gguf: GGUFFile, info: TensorInfo) -> np.ndarray:
    if info.type_name != "F32" or len(info.shape) != 1:
        raise MlxformerError(f"{gguf.path}: rope_freqs.weight must be a float32 vector, not {info.type_name} "
                             f"{info.shape}")
    factors = gguf.raw(info).view(np.float32)
    if not np.all(np.isfinite(factors)) or np.any(factors <= 0):
        raise MlxformerError(f"{gguf.path}: rope_freqs.weight has non-positive or non-finite factors")
    return factors


def _quantization_config(types: dict[str, str], arch: str = "llama") -> dict[str, Any]:
    """mlx-lm style ``quantization`` entry from GGUF tensor types: the most common bits as
    default, others per layer."""
    module_bits = {_hf_name(n, arch).rsplit(".", 1)[0]: QUANT_BITS[t] for n, t in types.items()
                   if t in QUANT_BITS and n != "rope_freqs.weight"}
    if not module_bits:
        return {}
    bits_values = list(module_bits.values())
    default_bits = max(sorted(set(bits_values)), key=bits_values.count)
    quantization: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default_bits}
    for module, bits in sorted(module_bits.items()):
        if bits != default_bits:
            quantization[module] = {"group_size": GROUP_SIZE, "bits": bits}
    return quantization
