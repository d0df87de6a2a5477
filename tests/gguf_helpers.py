"""Test-side GGUF makers, independent of mlxformer: round-to-nearest quantizers that write
llama.cpp's K-quant block layouts (gguf-py has dequantizers but no K-quantizers), llama.cpp's
per-tensor type mixes, and writers of GGUF files (with gguf-py's ``GGUFWriter``) from
transformers checkpoints or from another GGUF."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

QK_K = 256


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0.0, a / np.where(b == 0, 1.0, b))


def _affine_k(x: np.ndarray, sub: int, nmax: int, scale_max: int) -> tuple:
    """Super-block of sub-blocks with ``w = d*sc*q - dmin*m``: (d, dmin, sc, m, q)."""
    n = x.shape[0]
    x = x.reshape(n, -1, sub)
    low = np.minimum(x.min(-1), 0)
    scale, mins = (x.max(-1) - low) / nmax, -low
    d = (scale.max(-1) / scale_max).astype(np.float16).astype(np.float32)
    dmin = (mins.max(-1) / scale_max).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_safe_div(scale, d[:, None])), 0, scale_max)
    m = np.clip(np.round(_safe_div(mins, dmin[:, None])), 0, scale_max)
    step, offset = (d[:, None] * sc)[..., None], (dmin[:, None] * m)[..., None]
    q = np.clip(np.round(_safe_div(x + offset, step)), 0, nmax).astype(np.uint8)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q.reshape(n, -1)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins -> llama.cpp's 12-byte ``get_scale_min_k4`` packing."""
    first = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    second = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([first, second, third], axis=-1).astype(np.uint8)


def _nibble_runs(q: np.ndarray, run: int) -> np.ndarray:
    """Values [0, run) in low nibbles and [run, 2*run) in high nibbles of each ``run`` bytes."""
    n = q.shape[0]
    q = q.reshape(n, -1, 2, run)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, -1).astype(np.uint8)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine_k(x, 32, 15, 63)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, m), _nibble_runs(q, 32)], axis=-1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine_k(x, 32, 31, 63)
    n = q.shape[0]
    high = (q >> 4).reshape(n, 8, 32)  # bit s of byte i: high bit of sub-block s, value i
    qh = (high << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)).sum(axis=1).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, m), qh,
                           _nibble_runs(q & 0x0F, 32)], axis=-1)


def _two_bit_planes(q: np.ndarray) -> np.ndarray:
    """2-bit values: value h*128 + k*32 + i at bits 2k of byte h*32 + i -> (n, 64)."""
    n = q.shape[0]
    q = q.reshape(n, 2, 4, 32).astype(np.uint8)
    return sum(q[:, :, k] << (2 * k) for k in range(4)).reshape(n, 64).astype(np.uint8)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    x = x.reshape(n, 16, 16)
    scale = np.abs(x).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_safe_div(scale, d[:, None])), 0, 127)
    q = np.clip(np.round(_safe_div(x, (d[:, None] * sc)[..., None])), -32, 31).astype(np.int16) + 32
    q = q.reshape(n, QK_K).astype(np.uint8)
    low = (q & 0x0F).reshape(n, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    qh = _two_bit_planes(q >> 4)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=-1).astype(np.uint8)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine_k(x, 16, 3, 15)
    return np.concatenate([sc | (m << 4), _two_bit_planes(q), _f16_bytes(d), _f16_bytes(dmin)], axis=-1)


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    x = x.reshape(n, 16, 16)
    scale = np.abs(x).max(-1) / 4
    d = (scale.max(-1) / 31).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_safe_div(scale, d[:, None])), 0, 31)
    q = np.clip(np.round(_safe_div(x, (d[:, None] * sc)[..., None])), -4, 3).astype(np.int16) + 4
    q = q.reshape(n, QK_K).astype(np.uint8)
    hmask = ((q >> 2).reshape(n, 8, 32) << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)).sum(axis=1)
    s = (sc + 32).astype(np.uint8)  # 6-bit, stored with an offset of 32
    low = (s[:, :8] & 0x0F) | ((s[:, 8:] & 0x0F) << 4)
    high = sum(((s[:, 4 * k : 4 * k + 4] >> 4) & 3) << (2 * k) for k in range(4))
    return np.concatenate([hmask.astype(np.uint8), _two_bit_planes(q & 3), low, high.astype(np.uint8),
                           _f16_bytes(d)], axis=-1).astype(np.uint8)


K_QUANTIZERS: dict[T, Callable[[np.ndarray], np.ndarray]] = {
    T.Q2_K: quantize_q2_k, T.Q3_K: quantize_q3_k, T.Q4_K: quantize_q4_k, T.Q5_K: quantize_q5_k, T.Q6_K: quantize_q6_k,
}


def quantize(x: np.ndarray, qtype: T) -> np.ndarray:
    """(rows, cols) float32 -> raw bytes (rows, cols // block * block_bytes) of ``qtype``."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype == T.F32:
        return x
    if qtype == T.F16:
        return x.astype(np.float16)
    if qtype in K_QUANTIZERS:
        rows = x.shape[0]
        return K_QUANTIZERS[qtype](x.reshape(-1, QK_K)).reshape(rows, -1)
    return gguf.quants.quantize(x, qtype)


def roundtrip(x: np.ndarray, qtype: T) -> np.ndarray:
    """``x`` as the file stores it, dequantized by gguf-py."""
    if qtype in (T.F32,):
        return np.asarray(x, dtype=np.float32)
    if qtype == T.F16:
        return np.asarray(x, dtype=np.float16).astype(np.float32)
    return gguf.quants.dequantize(quantize(x, qtype), qtype).reshape(x.shape)


def add_tensor(writer: gguf.GGUFWriter, name: str, x: np.ndarray, qtype: T) -> None:
    data = quantize(x, qtype)
    if qtype in (T.F32, T.F16):
        writer.add_tensor(name, data)
    else:
        writer.add_tensor(name, data, raw_dtype=qtype)


# ---- llama.cpp's per-tensor type choices (llama_tensor_get_type, simplified to what these files use)

_FALLBACK = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def _use_more_bits(layer: int, n_layers: int) -> bool:
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def llama_cpp_type(mix: str, name: str, shape: tuple[int, ...], n_layers: int) -> T:
    """The type llama.cpp's quantizer gives tensor ``name`` (numpy shape) in file type ``mix``."""
    if len(shape) == 1 or name.endswith("_norm.weight"):
        return T.F32
    base = {"Q4_K_M": T.Q4_K, "Q5_K_M": T.Q5_K, "Q6_K": T.Q6_K, "Q8_0": T.Q8_0, "Q4_0": T.Q4_0,
            "Q3_K_M": T.Q3_K, "Q2_K": T.Q2_K}[mix]
    qtype = base
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if name == "output.weight" and mix != "Q8_0":
        qtype = T.Q6_K
    elif mix in ("Q4_K_M", "Q5_K_M") and (".attn_v." in name or ".ffn_down." in name):
        qtype = T.Q6_K if _use_more_bits(layer, n_layers) else base
    if shape[-1] % QK_K and qtype in _FALLBACK:
        qtype = _FALLBACK[qtype]
    return qtype


class FloatSource:
    """A GGUF's metadata and tensors dequantized by gguf-py: the float source of re-quantized files."""

    def __init__(self, path: Path):
        reader = gguf.GGUFReader(str(path))
        self.arch = str(reader.fields["general.architecture"].contents())
        self.n_layers = int(reader.fields[f"{self.arch}.block_count"].contents())
        self.fields = [(f.name, f.contents(), f.types) for f in reader.fields.values()
                       if not f.name.startswith("GGUF.") and f.name not in ("general.architecture", "general.alignment")]
        self.tensors = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
                        for t in reader.tensors}


def requantize_gguf(source: FloatSource, dst: Path, mix: str, tokenizer: bool = True) -> dict[str, T]:
    """Write ``source``'s tensors quantized with llama.cpp's per-tensor choices for ``mix``,
    with its metadata (without the vocabulary unless ``tokenizer``). Returns each tensor's type."""
    writer = gguf.GGUFWriter(str(dst), source.arch)
    for name, value, types in source.fields:
        if name.startswith("tokenizer.") and not tokenizer:
            continue
        vtype = gguf.GGUFValueType(types[0])
        sub = gguf.GGUFValueType(types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, vtype, sub_type=sub)
    if not tokenizer and f"{source.arch}.vocab_size" not in [name for name, _, _ in source.fields]:
        writer.add_vocab_size(len(source.tensors["token_embd.weight"]))
    chosen = {}
    for name, values in source.tensors.items():
        chosen[name] = llama_cpp_type(mix, name, values.shape, source.n_layers)
        add_tensor(writer, name, values, chosen[name])
    _finish(writer)
    return chosen


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---- transformers checkpoint -> GGUF, as llama.cpp's convert_hf_to_gguf.py writes it

_HF_TO_GGUF = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    stem, suffix = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, index, module = stem.split(".", 3)
        return f"blk.{index}.{_HF_TO_GGUF[module]}.{suffix}"
    return f"{_HF_TO_GGUF[stem]}.{suffix}"


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: HF half-split rotary rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(config: Any) -> np.ndarray:
    """convert_hf_to_gguf's ``rope_freqs`` for llama3 rope scaling."""
    scaling = config.rope_scaling if getattr(config, "rope_scaling", None) else config.rope_parameters
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = getattr(config, "rope_theta", None) or scaling["rope_theta"]
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _add_byte_vocab(writer: gguf.GGUFWriter, size: int) -> None:
    """A byte-level BPE vocabulary of ``size`` tokens: GPT-2's byte alphabet and one merge."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = [chr(c) for c in printable] + [chr(256 + i) for i in range(256 - len(printable))]
    tokens = (alphabet + [f"<extra_{i}>" for i in range(size)])[: size - 1] + ['!"']
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * size)
    writer.add_token_merges(['! "'])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)


def write_gguf_from_hf(
    path: Path, hf_model: Any, arch: str, type_of: Callable[[str, tuple], T],
    add_metadata: Callable[[gguf.GGUFWriter], None] | None = None, split_max_tensors: int = 0,
) -> dict[str, np.ndarray]:
    """Write ``hf_model`` (transformers, float32) as a GGUF of architecture ``arch``; each matrix
    gets ``type_of(gguf_name, shape)``; ``add_metadata(writer)`` may add keys. Returns the HF
    state dict as the file stores it (gguf-py round trip), to load into transformers as the reference.
    ``split_max_tensors``: write a split GGUF (``NAME-0000i-of-0000N.gguf``) of so many tensors a part."""
    config = hf_model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    theta = getattr(config, "rope_theta", None) or (config.rope_parameters or {}).get("rope_theta", 10000.0)
    writer.add_rope_freq_base(float(theta))
    writer.add_vocab_size(config.vocab_size)
    _add_byte_vocab(writer, config.vocab_size)
    if add_metadata is not None:
        add_metadata(writer)
    scaling = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    if scaling.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
    stored = {}
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        x = tensor.detach().float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            x = permute_rows(x, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            x = permute_rows(x, kv_heads)
        qtype = T.F32 if x.ndim == 1 else type_of(gguf_name(name), x.shape)
        add_tensor(writer, gguf_name(name), x, qtype)
        stored[name] = roundtrip(tensor.detach().float().numpy(), qtype)  # rows commute with the permutation
    _finish(writer)
    return stored
