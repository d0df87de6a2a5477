"""GGUF tensor types, mixed files, architectures and llama3 rope factors, against gguf-py and transformers.

Files are written by the test with gguf-py's ``GGUFWriter`` (K-quant blocks by the
round-to-nearest quantizers of ``gguf_helpers``), from tiny transformers checkpoints. The
reference model is transformers on the original checkpoint with each matrix replaced by the
values the file stores (gguf-py's ``dequantize``): exactly what a loader should compute.
"""

from __future__ import annotations

import copy
import json

import gguf
import mlx.core as mx
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from conftest import write_tiny_checkpoint
from gguf_helpers import _finish, write_gguf_from_hf
from mlxformer import convert, load
from mlxformer.errors import MlxformerError
from mlxformer.loader import apply_dtype_policy, build_model, is_quantized, read_checkpoint

TOKENS = [[3, 17, 200, 41, 9, 77, 128, 5, 250, 31, 64, 2, 99, 180, 7, 13] * 3]
# Exact types: both sides compute fp32 math on identical weights; only summation order differs
# (measured <= 2e-5 on these O(1) logits). Far below any wrong block layout, scale or bias.
EXACT_BOUND = 1e-4
# Q2_K/Q3_K/Q6_K are requantized to 8 bits, group 32 (max error 1/510 of each 32-group's range).
# On these sensitive random models that moves log-probs by ~1/4 of what the types' own rounding
# does (all-Q6_K: 0.18 vs 0.79 max, 0.028 vs 0.11 mean); the bound is a third of the latter.
INEXACT_BOUND = None
K_SHAPE = dict(hidden_size=256, intermediate_size=512, head_dim=64, num_attention_heads=4, num_key_value_heads=2)


pytestmark = pytest.mark.usefixtures("cpu_device")  # CPU policies, whatever the default device


def _all(qtype: T):
    return lambda name, shape: qtype


def _mixed_exact(name: str, shape: tuple) -> T:
    table = {"token_embd": T.Q4_K, "attn_q": T.Q5_K, "attn_k": T.Q4_0, "attn_v": T.Q5_1, "attn_output": T.Q4_1,
             "ffn_gate": T.Q5_0, "ffn_up": T.Q8_0, "ffn_down": T.Q4_K, "output": T.Q5_K}
    return table[name.split(".")[-2]]


def _mixed_16(name: str, shape: tuple) -> T:
    table = {"token_embd": T.Q6_K, "attn_v": T.Q3_K, "ffn_gate": T.Q2_K, "ffn_down": T.Q6_K, "output": T.Q6_K}
    return table.get(name.split(".")[-2], T.Q4_K)


# name -> (model_type, GGUF architecture, config overrides, type chooser, bound)
CASES = {
    "llama-f16": ("llama", "llama", {}, _all(T.F16), EXACT_BOUND),
    "llama-bf16": ("llama", "llama", {}, _all(T.BF16), EXACT_BOUND),
    "llama-q4_0": ("llama", "llama", {}, _all(T.Q4_0), EXACT_BOUND),
    "qwen2-q8_0": ("qwen2", "qwen2", {}, _all(T.Q8_0), EXACT_BOUND),
    "qwen3-tied-f16": ("qwen3", "qwen3", dict(head_dim=32, tie_word_embeddings=True), _all(T.F16), EXACT_BOUND),
    "llama-mixed-exact": ("llama", "llama", K_SHAPE, _mixed_exact, EXACT_BOUND),
    "qwen3-mixed-16": ("qwen3", "qwen3", K_SHAPE, _mixed_16, INEXACT_BOUND),
}


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _ours(config, weights) -> np.ndarray:
    model = build_model(config, weights)
    if is_quantized(model):
        apply_dtype_policy(model, None)  # CPU: float32 activations, packed values as stored
    else:
        model.set_dtype(mx.float32)
    return np.array(model(mx.array(TOKENS)).astype(mx.float32))


def _reference(hf_model, stored: dict[str, np.ndarray]) -> np.ndarray:
    model = copy.deepcopy(hf_model)
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in stored.items()}
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float().numpy()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """name -> (gguf path, reference logits), each file written once."""
    cache = {}

    def make(case: str):
        if case not in cache:
            model_type, arch, overrides, type_of, _ = CASES[case]
            directory = tmp_path_factory.mktemp(case)
            _, hf_model = write_tiny_checkpoint(directory / "hf", model_type, **overrides)
            path = directory / f"{case}.gguf"
            stored = write_gguf_from_hf(path, hf_model, arch, type_of)
            with torch.no_grad():
                original = hf_model(torch.tensor(TOKENS)).logits.numpy()
            cache[case] = (path, _reference(hf_model, stored), original)
        return cache[case]

    return make


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_matches_transformers(case, written):
    path, expected, original = written(case)
    config, weights, _ = read_checkpoint(path)
    got = _ours(config, weights)
    err = np.abs(log_softmax(got) - log_softmax(expected))
    if CASES[case][4] is None:  # within a third of the file types' own rounding effect
        own = np.abs(log_softmax(original) - log_softmax(expected))
        assert err.max() < own.max() / 3 and err.mean() < own.mean() / 3, (err.max(), own.max())
    else:
        assert err.max() < CASES[case][4]
    assert (got.argmax(-1) == expected.argmax(-1)).mean() > 0.95


def test_mixed_file_gets_per_layer_bits(written):
    path, _, _ = written("qwen3-mixed-16")
    config, weights, _ = read_checkpoint(path)
    quant = config["quantization"]
    assert quant["bits"] == 4 and quant["group_size"] == 32  # Q4_K: the most common type
    for module in ("model.embed_tokens", "lm_head", "model.layers.1.mlp.down_proj", "model.layers.0.mlp.gate_proj",
                   "model.layers.0.self_attn.v_proj"):
        assert quant[module] == {"group_size": 32, "bits": 8}, module  # Q6_K / Q2_K / Q3_K
    assert weights["model.embed_tokens.scales"].dtype == mx.float32
    model = build_model(config, weights)
    import mlx.nn as nn

    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)


def test_llama3_rope_freqs_match_transformers_on_original_checkpoint(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 1000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    _, hf_model = write_tiny_checkpoint(tmp_path / "hf", "llama", rope_parameters=rope, max_position_embeddings=128)
    path = tmp_path / "llama3.gguf"
    write_gguf_from_hf(path, hf_model, "llama", _all(T.F32))
    assert "rope_freqs.weight" in [t.name for t in gguf.GGUFReader(str(path)).tensors]
    config, weights, _ = read_checkpoint(path)
    # the factors are recognised as llama3's, and its parameters recovered (low_freq_factor 1)
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    with torch.no_grad():
        expected = hf_model(torch.tensor(TOKENS)).logits.numpy()  # the original float32 checkpoint
    got = _ours(config, weights)
    assert np.abs(log_softmax(got) - log_softmax(expected)).max() < EXACT_BOUND
    plain = dict(config, rope_scaling=None)  # without the factors the far positions go wrong
    assert np.abs(log_softmax(_ours(plain, weights)) - log_softmax(expected)).max() > 100 * EXACT_BOUND


LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 1000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


# Head size 8, base 5e5: wavelengths 6.3, 167, 4443 and 118k, none inside the smooth band [256, 1024],
# so every factor is 1 or 8 and no band point pins the parameters (any that reproduce them do).
SMALL_HEAD_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}


@pytest.mark.parametrize("rope,head_dim", [(LLAMA31_ROPE, None), (SMALL_HEAD_ROPE, 8)], ids=["llama31", "no-band"])
def test_llama3_gguf_converts_to_a_dir_mlx_lm_reads_with_the_same_logits(tmp_path, rope, head_dim):
    """A Llama-3.1-style GGUF (``rope_freqs`` from llama3 scaling) used to convert to
    ``rope_type: freq_factors``, which mlx-lm refuses ("Unsupported RoPE type"); so did one whose
    factors are all 1 or ``factor`` (small head sizes)."""
    from mlx_lm.utils import load_model

    _, hf_model = write_tiny_checkpoint(tmp_path / "hf", "llama", rope_parameters=rope,
                                        max_position_embeddings=4096, **({"head_dim": head_dim} if head_dim else {}))
    path = tmp_path / "llama31.gguf"
    write_gguf_from_hf(path, hf_model, "llama", _all(T.Q8_0))
    if head_dim:
        (freqs,) = [t.data for t in gguf.GGUFReader(str(path)).tensors if t.name == "rope_freqs.weight"]
        assert sorted(set(freqs.tolist())) == [1.0, 8.0]
    out = convert(path, tmp_path / "converted", progress=False)
    assert json.loads((out / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"
    ref, _ = load_model(out)  # mlx-lm's own reading of the converted dir
    ref.set_dtype(mx.float32)
    expected = np.array(ref(mx.array(TOKENS)))
    direct, _ = load(path)  # float32 compute (CPU policy) over the same packed weights
    got = np.array(direct(mx.array(TOKENS)))
    assert np.abs(log_softmax(got) - log_softmax(expected)).max() < EXACT_BOUND
    plain = dict(read_checkpoint(path)[0], rope_scaling=None)  # the comparison can fail: no scaling
    assert np.abs(log_softmax(_ours(plain, read_checkpoint(path)[1])) - log_softmax(expected)).max() > 100 * EXACT_BOUND


def test_gguf_with_other_rope_factors_loads_but_is_not_converted(tmp_path, monkeypatch):
    import gguf_helpers

    _, hf_model = write_tiny_checkpoint(tmp_path / "hf", "llama", rope_parameters=LLAMA31_ROPE,
                                        max_position_embeddings=128)
    factors = np.linspace(1.0, 3.0, 8, dtype=np.float32) ** 2  # smooth, but no llama3 curve
    monkeypatch.setattr(gguf_helpers, "llama3_rope_factors", lambda config: factors)
    path = tmp_path / "other.gguf"
    write_gguf_from_hf(path, hf_model, "llama", _all(T.F32))
    config, _, _ = read_checkpoint(path)
    assert config["rope_scaling"]["rope_type"] == "freq_factors"
    assert config["rope_scaling"]["freq_factors"] == [float(f) for f in factors]
    load(path)
    with pytest.raises(MlxformerError, match="rope_freqs factors are not llama3's"):
        convert(path, tmp_path / "converted", progress=False)
    assert not (tmp_path / "converted").exists()


def test_convert_keeps_mixed_gguf_exact(written, tmp_path):
    path, _, _ = written("llama-mixed-exact")
    direct, _ = load(path, dtype=None)
    expected = np.array(direct(mx.array(TOKENS)))
    out = convert(path, tmp_path / "converted", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["model.layers.0.self_attn.q_proj"] == {"group_size": 32, "bits": 5}  # Q5_K
    converted, _ = load(out, dtype=None)
    np.testing.assert_array_equal(np.array(converted(mx.array(TOKENS))), expected)


# ---------------------------------------------------------------------------- single tensors

F16_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q2_K: [80, 82],
              T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}
EXACT = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K)


def _random_blocks(qtype: T, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random but valid raw blocks: any bytes, with finite float16 scale fields."""
    rng = np.random.default_rng(seed)
    values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // values, block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scale = rng.choice([1e-4, 1e-2, 0.5, 30.0]) * rng.standard_normal((len(blocks), 1))
        blocks[:, offset : offset + 2] = scale.astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(F16_FIELDS), ids=lambda t: t.name)
def test_blocks_dequantize_like_gguf_py(qtype, tmp_path):
    rows, cols = 64, 512
    raw = _random_blocks(qtype, rows, cols, seed=int(qtype))
    path = tmp_path / f"{qtype.name}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in dict(embedding_length=cols, block_count=1, feed_forward_length=rows, head_count=1,
                           layer_norm_rms_eps=1e-5, vocab_size=32).items():
        getattr(writer, f"add_{key}")(value)
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=qtype)
    _finish(writer)
    config, weights, _ = read_checkpoint(path)
    expected = gguf.quants.dequantize(gguf.GGUFReader(str(path)).tensors[0].data, qtype)
    bits = config["quantization"]["bits"]
    w = {k: weights[f"model.layers.0.mlp.down_proj.{k}"] for k in ("weight", "scales", "biases")}
    got = np.array(mx.dequantize(w["weight"], w["scales"].astype(mx.float32), w["biases"].astype(mx.float32),
                                 group_size=32, bits=bits))
    if qtype in EXACT:
        np.testing.assert_array_equal(got, expected)
    else:  # 8-bit affine, group 32: half a step of (max - min) / 255 per group, plus float32 rounding
        groups = expected.reshape(rows, -1, 32)
        step = (groups.max(-1) - groups.min(-1)) / 255
        rounding = 4 * np.finfo(np.float32).eps * np.abs(groups).max(-1)
        err = np.abs(got - expected).reshape(rows, -1, 32).max(-1)
        assert np.all(err <= 0.5 * step * (1 + 1e-3) + rounding)
