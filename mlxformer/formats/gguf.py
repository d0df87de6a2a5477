"""GGUF files as a checkpoint: an HF-style config from the metadata and a lazy mapping of
HF-named MLX tensors, each decoded alone when it is accessed.

``gguf_reader`` parses and checks the container; ``gguf_quants`` decodes the blocks. Each
tensor keeps its own type: exact types become MLX affine triplets (``weight``/``scales``/
``biases``, group 32, their own bits), Q2_K/Q3_K/Q6_K are requantized to 8 bits (see
``INEXACT_BITS``), floats stay float. The per-layer bits go into an mlx-lm style
``quantization`` config entry. Names map to HF names through ``gguf_names``' table,
llama.cpp's Q/K row permutation is undone, and ``rope_freqs`` becomes the config's rope
scaling (``gguf_rope``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from mlxformer.errors import MlxformerError
from mlxformer.formats.gguf_quants import EXACT_TYPES, FLOAT_DECODED_TYPES, GROUP_SIZE, decode_codes, decode_mxfp4, \
    decode_values, requantize
from mlxformer.formats.gguf_families import GGUF_ARCHITECTURES, NORM_SHIFTED_ARCHS, arch_config, gemma4_config
from mlxformer.formats.gguf_hybrid import HYBRID_ARCHS, undo_converter
from mlxformer.formats.gguf_names import CONFIG_TENSORS, MTP_ARCHS, PERMUTED_QK_ARCHS, hf_name, is_block_from, \
    mtp_name
from mlxformer.formats.gguf_reader import GGUFFile, TensorInfo
from mlxformer.formats.gguf_split import read_any_gguf
from mlxformer.formats.gguf_rope import rope_scaling_from_factors
from mlxformer.formats.tensors import TensorEntry

FLOAT_TYPES = ("F32", "F16", "BF16")
# Q2_K/Q3_K/Q6_K (16-value sub-blocks) are requantized to 8 bits, group 32: the measured
# choice (docs/design/gguf.md), a fraction of the type's own rounding error at ~1.5x its size.
INEXACT_BITS = 8
SUPPORTED_TYPES = FLOAT_TYPES + EXACT_TYPES + FLOAT_DECODED_TYPES + ("MXFP4",)  # MXFP4: MLX's own mxfp4
# Bits of the MLX layer each quantized GGUF type becomes (all with groups of 32).
QUANT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5,
              **dict.fromkeys(FLOAT_DECODED_TYPES, INEXACT_BITS)}
LEGACY_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # float16 scales in the file, float16 in MLX


SUPPORTED_ARCHITECTURES = GGUF_ARCHITECTURES
# Keys Gemma 4 writes as one value per layer (the shared reading takes the first layer's)
_PER_LAYER_KEYS = ("feed_forward_length", "attention.head_count_kv")

def _meta(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    value = metadata.get(key, default)
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def config_from_metadata(metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """An HF ``config.json`` dict from GGUF metadata (as returned by ``read_gguf``); its sizes
    are checked against the tensors by ``checkpoint.check_config``."""
    arch = _meta(metadata, "general.architecture")
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
        raise MlxformerError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def field(name: str, default: Any = ...) -> Any:
        """``{arch}.{name}`` as a finite number (a bool when ``default`` is one); ``default`` when
        absent (None: None; none: an error)."""
        value = _meta(metadata, f"{arch}.{name}", None if default is ... else default)
        if isinstance(value, list) and value and name in _PER_LAYER_KEYS:  # Gemma 4: its reader takes the rest
            value = value[0]
        if value is None:
            if default is None:
                return None
            raise MlxformerError(f"GGUF metadata is missing {arch}.{name}")
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise MlxformerError(f"GGUF metadata {arch}.{name} is not a bool: {str(value)[:50]!r}")
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
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
        # RMSNorm's eps, or LayerNorm's (GPT-2)
        "rms_norm_eps": float(field("attention.layer_norm_rms_epsilon", None) or field("attention.layer_norm_epsilon")),
        "rope_theta": float(field("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(field("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    scaling_type = _meta(metadata, f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type not in ("linear", "yarn"):
            raise MlxformerError(f"unsupported GGUF rope scaling type {str(scaling_type)[:50]!r}")
        config["rope_scaling"] = {"rope_type": scaling_type, "factor": float(field("rope.scaling.factor"))}
        if scaling_type == "yarn":
            config["rope_scaling"].update(_yarn_keys(field))
    pattern = _meta(metadata, f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one flag per layer (OLMo 3)
        config["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    first_mtp = _first_mtp_block(metadata, arch)  # MTP blocks end the file's (GLM, DeepSeek, Qwen3.5): not the decoder's
    if first_mtp is not None:
        config["num_hidden_layers"] = first_mtp
    recurrent = _meta(metadata, f"{arch}.attention.recurrent_layers")
    if isinstance(recurrent, list):  # one flag per layer (Gated DeltaNet hybrids; MTP layers last)
        config["layer_types"] = ["linear_attention" if r else "full_attention" for r in recurrent][:config["num_hidden_layers"]]
    if arch == "qwen2":
        config["attention_bias"] = True
    config.update(arch_config(arch, field, config, frozenset(tensor_names)))
    if arch == "gemma4":
        config.update(gemma4_config(field, config, lambda name: _meta(metadata, f"{arch}.{name}"), tensor_names))
    return config


def _yarn_keys(field: Callable[[str, Any], Any]) -> dict[str, Any]:
    """YaRN's parameters as llama.cpp writes them (``yarn_log_multiplier``: DeepSeek's and
    Ministral 3's ``mscale_all_dim``, their ``mscale`` being equal)."""
    keys: dict[str, Any] = {"original_max_position_embeddings": int(field("rope.scaling.original_context_length")),
                            "beta_fast": float(field("rope.scaling.yarn_beta_fast", 32.0)),
                            "beta_slow": float(field("rope.scaling.yarn_beta_slow", 1.0))}
    attention_factor, log_mul = field("rope.scaling.yarn_attn_factor", None), field("rope.scaling.yarn_log_multiplier", None)
    if attention_factor is not None:
        keys["attention_factor"] = float(attention_factor)
    elif log_mul:
        keys.update(mscale=float(log_mul), mscale_all_dim=float(log_mul))
    return keys


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order (interleaved rotary pairs) back to HF's half-split order."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise MlxformerError(f"GGUF Q/K projection with {rows} rows does not split into {n_heads} heads")
    # (heads, head_dim/2, 2, ...) -> (heads, 2, head_dim/2, ...)
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _half_exactly(values: np.ndarray, gguf: GGUFFile, info: TensorInfo) -> np.ndarray:
    """A legacy type's scales or biases (float16 values, or ``-8 * d``-like multiples of them)
    as float16; they round-trip exactly unless they overflow, which is refused."""
    half = values.astype(np.float16)
    if not (np.all(np.isfinite(half)) and np.array_equal(half.astype(np.float32), values)):
        raise MlxformerError(f"{gguf.path}: tensor {info.name!r} has block scales beyond float16's range")
    return half


def _float_tensor(gguf: GGUFFile, info: TensorInfo) -> mx.array:
    raw = gguf.raw(info)
    if info.type_name == "F32":
        return mx.array(raw.view(np.float32).reshape(info.shape))
    if info.type_name == "F16":
        return mx.array(raw.view(np.float16).reshape(info.shape))
    return mx.array(raw.view(np.uint16).reshape(info.shape)).view(mx.bfloat16)


# Quantized tensors are decoded this many bytes of the file at a time, each run's pages
# released once decoded: peak memory is the output plus one run, not twice the tensor.
RUN_BYTES = 4 * 1024 * 1024


def _decoded_rows(gguf: GGUFFile, info: TensorInfo, decode: Callable[[np.ndarray, int], Any]) -> dict[str, np.ndarray]:
    """``decode(raw_rows, n_rows)`` (a dict of row-major arrays) over runs of whole rows of a
    quantized tensor, assembled into full arrays."""
    raw, rows = gguf.raw(info), math.prod(info.shape[:-1])
    row_bytes = info.nbytes // rows
    step = max(1, RUN_BYTES // row_bytes)
    out: dict[str, np.ndarray] = {}
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        part = decode(raw[start * row_bytes : stop * row_bytes], stop - start)
        for key, value in part.items():
            if key not in out:
                out[key] = np.empty((rows, *value.shape[1:]), dtype=value.dtype)
            out[key][start:stop] = value
        gguf.release(info, start * row_bytes, stop * row_bytes)
    return out


def _decode(gguf: GGUFFile, info: TensorInfo, heads: int | None) -> dict[str, mx.array]:
    """One tensor's output arrays: ``weight`` (a float tensor, of whatever suffix), or
    ``weight``/``scales``/``biases`` (a quantized matrix), with the shapes and dtypes
    ``_entries`` announced."""
    if info.type_name in FLOAT_TYPES:
        return {"weight": _unpermute_mx(_float_tensor(gguf, info), heads)}
    cols, kind, lead = info.shape[-1], info.type_name, info.shape[:-1]  # lead: (rows,) or (experts, rows)
    if kind == "MXFP4":  # kept as MLX mxfp4 (gpt-oss's experts)
        out = _decoded_rows(gguf, info, lambda raw, n: decode_mxfp4(raw, n, cols))
        return {key: mx.array(value.reshape(*lead, -1)) for key, value in out.items()}
    if len(info.shape) == 1 or kind not in EXACT_TYPES:  # float values (a vector, or to requantize)
        values = _decoded_rows(gguf, info, lambda raw, n: {"v": decode_values(raw, kind, n, cols)})["v"]
        if len(info.shape) == 1:
            return {"weight": _unpermute_mx(mx.array(values.reshape(info.shape)), heads)}
        if heads is not None:
            values = _unpermute_rows(values, heads)
        quantized = requantize(values, INEXACT_BITS)  # (all rows, ...) each
        return {k: v.reshape(*lead, -1) for k, v in zip(("weight", "scales", "biases"), quantized)}

    def codes(raw: np.ndarray, n: int) -> dict[str, np.ndarray]:
        c = decode_codes(raw, kind, n, cols)
        if kind in LEGACY_TYPES:
            return {"weight": c.packed, "scales": _half_exactly(c.scales, gguf, info),
                    "biases": _half_exactly(c.biases, gguf, info)}
        return {"weight": c.packed, "scales": c.scales, "biases": c.biases}

    out = _decoded_rows(gguf, info, codes)
    if heads is not None:
        out = {k: _unpermute_rows(v, heads) for k, v in out.items()}
    arrays = {}
    for key in list(out):  # (all rows, n) -> (*lead, n); each numpy copy freed once MLX holds it
        arrays[key] = mx.array(out.pop(key).reshape(*lead, -1))
    return arrays


def _unpermute_mx(array: mx.array, heads: int | None) -> mx.array:
    if heads is None:
        return array
    if array.dtype == mx.bfloat16:
        return mx.array(_unpermute_rows(np.array(array.view(mx.uint16)), heads)).view(mx.bfloat16)
    return mx.array(_unpermute_rows(np.array(array), heads))


_FLOAT_DTYPES = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}


def _entries(path: Path, info: TensorInfo, name: str) -> dict[str, TensorEntry]:
    """The HF-named arrays GGUF tensor ``info`` (HF name ``name``) becomes, by output key."""
    if info.type_name not in SUPPORTED_TYPES:
        raise MlxformerError(f"{path}: tensor {info.name!r} has GGUF type {info.type_name}, which is not supported "
                             f"(supported: {', '.join(SUPPORTED_TYPES)})")
    if info.type_name in FLOAT_TYPES:
        return {"weight": TensorEntry(name, info.shape, _FLOAT_DTYPES[info.type_name], path)}
    if len(info.shape) == 1:  # a quantized vector: decoded to float values
        return {"weight": TensorEntry(name, info.shape, mx.float32, path)}
    module, suffix = name.rsplit(".", 1)
    if suffix != "weight":
        raise MlxformerError(f"{path}: tensor {info.name!r} is quantized but is not a weight matrix")
    *lead, cols = info.shape  # (rows, cols), or (experts, rows, cols) for stacked experts
    if info.type_name == "MXFP4":
        return {"weight": TensorEntry(f"{module}.weight", (*lead, cols // 8), mx.uint32, path),
                "scales": TensorEntry(f"{module}.scales", (*lead, cols // 32), mx.uint8, path)}
    bits = QUANT_BITS[info.type_name]
    scale_dtype = mx.float16 if info.type_name in LEGACY_TYPES else mx.float32
    return {"weight": TensorEntry(f"{module}.weight", (*lead, cols * bits // 32), mx.uint32, path),
            "scales": TensorEntry(f"{module}.scales", (*lead, cols // GROUP_SIZE), scale_dtype, path),
            "biases": TensorEntry(f"{module}.biases", (*lead, cols // GROUP_SIZE), scale_dtype, path)}


class _Decoder:
    """Decodes the GGUF tensor behind an HF-named entry; the last tensor's arrays are kept,
    so that reading its ``weight``, ``scales`` and ``biases`` decodes it once."""

    def __init__(self, gguf: GGUFFile, sources: dict[str, tuple[TensorInfo, str]], heads: dict[str, int],
                 shift_norms: bool = False):
        self.gguf, self.sources, self.heads = gguf, sources, heads
        self.shift_norms = shift_norms  # Gemma: the converter stored every RMSNorm weight as 1 + weight
        self._last: tuple[str, dict[str, mx.array]] | None = None

    def __call__(self, entry: TensorEntry) -> mx.array:
        info, key = self.sources[entry.name]
        if self._last is None or self._last[0] != info.name or key not in self._last[1]:
            projection = entry.name.rsplit(".", 2)[-2]
            arrays = _decode(self.gguf, info, self.heads.get(projection))
            if self.shift_norms and entry.name.endswith("norm.weight"):
                arrays["weight"] = arrays["weight"] - 1
            self._last = (info.name, arrays)
            mx.eval(self._last[1])  # requantized types are computed lazily from the mapped bytes
            self.gguf.release(info)
        return self._last[1].pop(key)


def open_gguf(path: Path) -> tuple[dict[str, Any], dict[str, TensorEntry], Callable[[TensorEntry], mx.array],
                                   dict[str, Any], int]:
    """``(config with quantization, HF-named entries, loader of one entry, metadata, header
    bytes)`` of a GGUF file (or of a split GGUF, given any of its parts: ``gguf_split``); every
    name and type is checked, no tensor is decoded."""
    gguf = read_any_gguf(path)
    arch = gguf.metadata.get("general.architecture")
    first_mtp = _first_mtp_block(gguf.metadata, str(arch))
    read_mtp = arch in MTP_ARCHS  # MTP blocks as the hub's ``mtp.*`` (``--mtp``); others' are not read
    tensors = {name: info for name, info in gguf.tensors.items()
               if name not in CONFIG_TENSORS and (read_mtp or not is_block_from(name, first_mtp))}
    names = {name: mtp_name(name, str(arch), first_mtp) if is_block_from(name, first_mtp) and first_mtp is not None
             else hf_name(name, str(arch)) for name in tensors}
    entries: dict[str, TensorEntry] = {}
    sources: dict[str, tuple[TensorInfo, str]] = {}
    for gguf_name, info in tensors.items():  # every name and type checked before the metadata
        for key, entry in _entries(path, info, names[gguf_name]).items():
            entries[entry.name] = entry
            sources[entry.name] = (info, key)
    config = config_from_metadata(gguf.metadata, set(tensors))
    rope_freqs = gguf.tensors.get("rope_freqs.weight")
    if arch == "gemma4":
        _gemma4_tensors(gguf, rope_freqs, config)
    elif rope_freqs is not None:
        factors = _rope_factors(gguf, rope_freqs, config["head_dim"])
        config["rope_scaling"] = rope_scaling_from_factors(factors, config["rope_theta"], config["head_dim"])
    long, short = gguf.tensors.get("rope_factors_long.weight"), gguf.tensors.get("rope_factors_short.weight")
    if long is not None or short is not None:  # Phi-3.5 / Phi-4-mini LongRoPE
        if long is None or short is None:
            raise MlxformerError(f"{path}: LongRoPE needs both rope_factors_long and rope_factors_short")
        rotary = int(config["head_dim"] * config.get("partial_rotary_factor", 1.0))
        attention_factor = gguf.metadata.get(f"{arch}.rope.scaling.attn_factor")
        config["rope_scaling"] = {
            "rope_type": "longrope", "long_factor": _rope_factors(gguf, long, rotary).tolist(),
            "short_factor": _rope_factors(gguf, short, rotary).tolist(),
            **({} if attention_factor is None else {"attention_factor": float(attention_factor)}),
        }
    permute = arch in PERMUTED_QK_ARCHS
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]} if permute else {}
    quantization = _quantization_config({names[n]: info.type_name for n, info in tensors.items()
                                         if len(info.shape) >= 2})
    if quantization:
        config["quantization"] = quantization
    decoder: Callable[[TensorEntry], mx.array] = _Decoder(gguf, sources, heads, arch in NORM_SHIFTED_ARCHS)
    if arch in HYBRID_ARCHS:  # Gated DeltaNet: the converter's edits undone
        config, entries, decoder = undo_converter(str(arch), config, entries, decoder)
    return config, entries, decoder, gguf.metadata, gguf.header_bytes


def _first_mtp_block(metadata: dict[str, Any], arch: str) -> int | None:
    """The index of the first multi-token-prediction block (``nextn_predict_layers`` of them end
    the file's blocks: GLM-4.5, GLM-4.7-Flash), None when there are none."""
    blocks, nextn = metadata.get(f"{arch}.block_count"), metadata.get(f"{arch}.nextn_predict_layers")
    if nextn is None:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (blocks, nextn)) or not 0 <= nextn < blocks:
        raise MlxformerError(f"GGUF metadata {arch}.nextn_predict_layers {str(nextn)[:20]} does not fit "
                             f"{arch}.block_count {str(blocks)[:20]}")
    return blocks - nextn
def _gemma4_tensors(gguf: GGUFFile, info: TensorInfo | None, config: dict[str, Any]) -> None:
    """Gemma 4's config from its tensors: the per-layer embedding's vocabulary, and the full
    layers' ``rope_freqs`` (1 for each rotated pair, then 1e30: unrotated), the proportional
    RoPE's ``partial_rotary_factor``."""
    per_layer = gguf.tensors.get("per_layer_token_embd.weight")
    if per_layer is not None:
        config["vocab_size_per_layer_input"] = int(per_layer.shape[0])
    if info is None:
        raise MlxformerError(f"{gguf.path}: a gemma4 GGUF needs rope_freqs (its full layers' RoPE)")
    head_dim = config["global_head_dim"]
    factors = _rope_factors(gguf, info, head_dim)
    rotated = int(np.sum(factors == 1.0))
    if not (np.all(factors[:rotated] == 1.0) and np.all(factors[rotated:] >= 1e20)):
        raise MlxformerError(f"{gguf.path}: gemma4 rope_freqs must be 1 for rotated pairs, then >= 1e20")
    config["rope_parameters"]["full_attention"]["partial_rotary_factor"] = 2 * rotated / head_dim


def _rope_factors(gguf: GGUFFile, info: TensorInfo, head_dim: Any) -> np.ndarray:
    """``rope_freqs`` / ``rope_factors_{long,short}``: one positive float32 factor per rotary
    frequency (``head_dim`` rotated features / 2)."""
    name = info.name
    if info.type_name != "F32" or len(info.shape) != 1:
        raise MlxformerError(f"{gguf.path}: {name} must be a float32 vector, not {info.type_name} {info.shape}")
    if not isinstance(head_dim, int) or info.shape[0] * 2 != head_dim:
        raise MlxformerError(f"{gguf.path}: {name} has {info.shape[0]} factors, the head dim "
                             f"{head_dim} needs {head_dim // 2 if isinstance(head_dim, int) else '?'}")
    factors = gguf.raw(info).view(np.float32)
    if not np.all(np.isfinite(factors)) or np.any(factors <= 0):
        raise MlxformerError(f"{gguf.path}: {name} has non-positive or non-finite factors")
    return factors

def _quantization_config(types: dict[str, str]) -> dict[str, Any]:
    """mlx-lm style ``quantization`` entry from the GGUF types of HF-named tensors: the most
    common bits as default, others per layer."""
    module_bits = {n.rsplit(".", 1)[0]: QUANT_BITS[t] for n, t in types.items() if t in QUANT_BITS}
    mxfp4 = sorted(n.rsplit(".", 1)[0] for n, t in types.items() if t == "MXFP4")
    if mxfp4 and not module_bits:  # MXFP4 experts, the rest float
        return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    if not module_bits:
        return {}
    bits_values = list(module_bits.values())
    default_bits = max(sorted(set(bits_values)), key=bits_values.count)
    quantization: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default_bits}
    for module, bits in sorted(module_bits.items()):
        if bits != default_bits:
            quantization[module] = {"group_size": GROUP_SIZE, "bits": bits}
    for module in mxfp4:
        quantization[module] = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    return quantization
