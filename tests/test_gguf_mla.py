"""GGUF files written by llama.cpp's own ``convert_hf_to_gguf.py`` from the tiny GLM-4.5
(``glm4_moe`` -> ``glm4moe``) and multi-head latent attention checkpoints of ``test_mla``
(DeepSeek-V2/V3 and GLM-4.7-Flash -> ``deepseek2``), loaded by mlxformer and compared with
transformers' logits on the original checkpoint; then ``mlxformer convert`` of each GGUF loaded
by mlx-lm with mlxformer's logits on the GGUF.

The converter splits MLA's ``kv_b_proj`` per head into ``attn_k_b`` (transposed) and
``attn_v_b`` and writes the router's ``e_score_correction_bias`` as ``exp_probs_b``; the GLM-4.5
case carries a real multi-token-prediction block (``blk.3.nextn.*``, dropped on load). The
vocabularies are SmolLM2's BPE (a hash llama.cpp knows), with the four special tokens its GLM
vocabulary step looks up for the GLM families. What the file cannot say is kept out of the
checkpoints: YaRN's ``mscale`` apart from ``mscale_all_dim`` (only the latter is written;
llama.cpp takes them equal, as the released DeepSeek-V3 config has them).
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import test_mla
from conftest import max_diff
from mlxformer import convert, load
from mlxformer.models.moe import SparseMoE
from mlxformer.tools.planning import footprint
from test_gguf_families import run_converter

SEQ_LEN = 40
BOUND = 3e-4  # float32 on both sides
GLM_TOKENS = ["[gMASK]", "<|user|>", "<|observation|>"]  # with SmolLM2's <|endoftext|>
_YARN = test_mla.CASES["deepseek_v3"]["rope_parameters"]
# scoring_func: the released config's key, written as expert_gating_func; mscale as mscale_all_dim
_V3 = {"scoring_func": "sigmoid", "rope_parameters": {**_YARN, "mscale": _YARN["mscale_all_dim"]}}
# name -> (test_mla family, overrides, the converter's --outtype)
CASES = {
    "glm4_moe": ("glm4_moe", {}, "f32"),  # four groups of two experts, two groups kept
    "deepseek_v3": ("deepseek_v3", _V3, "f32"),
    "deepseek_v2": ("deepseek_v2", {}, "f32"),  # softmax, group-limited (no gating key, no correction bias)
    "glm4_moe_lite": ("glm4_moe_lite", {}, "f32"),  # no gating key, a correction bias: sigmoid
    # Q8_0 where rows split in blocks of 32 (attn_k_b/attn_v_b 3-D, the dense down projection), F16 elsewhere
    "deepseek_v3-q8_0": ("deepseek_v3", _V3, "q8_0"),
}
ROUTERS = {"glm4_moe": "noaux_tc", "deepseek_v3": "noaux_tc", "deepseek_v2": "group_limited_greedy",
           "glm4_moe_lite": "noaux_tc"}


def add_mtp_block(directory, layers: int) -> None:
    """Append a multi-token-prediction block after the ``layers`` decoder layers, as GLM-4.5's
    checkpoints store it (a copy of the last layer plus ``eh_proj``/``enorm``/``hnorm``/
    ``shared_head.norm``)."""
    path = directory / "model.safetensors"
    tensors = load_file(path)
    last = f"model.layers.{layers - 1}."
    block = {k.replace(last, f"model.layers.{layers}."): v.clone() for k, v in tensors.items() if k.startswith(last)}
    hidden = tensors["model.norm.weight"].shape[0]
    block.update({f"model.layers.{layers}.eh_proj.weight": torch.randn(hidden, 2 * hidden) * 0.02,
                  **{f"model.layers.{layers}.{n}.weight": torch.ones(hidden)
                     for n in ("enorm", "hnorm", "shared_head.norm")}})
    save_file({**tensors, **block}, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def converted(tmp_path_factory, hf_smollm_tokenizer):
    """name -> (transformers model, GGUF path, the converter's error or None)."""
    import copy

    root = tmp_path_factory.mktemp("gguf_mla")
    models, jobs = {}, []
    for name, (family, overrides, outtype) in CASES.items():
        tokenizer = copy.deepcopy(hf_smollm_tokenizer)
        if family.startswith("glm"):
            tokenizer.add_special_tokens({"additional_special_tokens": GLM_TOKENS})
        directory, models[name] = test_mla.write_family(root / name, family, vocab_size=len(tokenizer), **overrides)
        (directory / "tokenizer.json").unlink()  # test_mla's byte tokenizer: the converter needs a BPE it knows
        tokenizer.save_pretrained(directory)
        if name == "glm4_moe":
            assert json.loads((directory / "config.json").read_text())["num_nextn_predict_layers"] == 1
            add_mtp_block(directory, models[name].config.num_hidden_layers)
        jobs.append({"name": name, "argv": [str(directory), "--outtype", outtype, "--outfile", str(root / f"{name}.gguf")]})
    errors = run_converter(root, jobs)
    return {name: (models[name], root / f"{name}.gguf", errors[name]) for name in CASES}


pytestmark = pytest.mark.usefixtures("cpu_module")


def tokens() -> np.ndarray:
    return np.random.default_rng(1).integers(3, 256, size=SEQ_LEN)


def q8_0(x: np.ndarray) -> np.ndarray:
    """``x`` through gguf-py's Q8_0 quantize/dequantize (blocks along the last axis)."""
    from gguf import GGMLQuantizationType, quants

    x = np.ascontiguousarray(x)
    return quants.dequantize(quants.quantize(x, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0).reshape(x.shape)


def converter_rounded(hf_model):
    """A copy of ``hf_model`` with its matrices as ``--outtype q8_0`` stores them: Q8_0 where a
    stored row splits into blocks of 32, float16 elsewhere, the router in float32; ``kv_b_proj``
    rounded as the converter stores it, split per head with the key part transposed."""
    import copy

    config = hf_model.config
    H, nope, v, rank = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank
    rounded = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, param in rounded.named_parameters():
            x = param.numpy()
            if name.endswith("kv_b_proj.weight"):
                kv = x.reshape(H, nope + v, rank)  # (H * (nope + v), rank) -> per head
                k_b = q8_0(kv[:, :nope].transpose(0, 2, 1)).transpose(0, 2, 1)  # stored (H, rank, nope)
                x = np.concatenate([k_b, q8_0(kv[:, nope:])], axis=1).reshape(x.shape)
            elif x.ndim >= 2 and not name.endswith("mlp.gate.weight"):
                x = q8_0(x) if x.shape[-1] % 32 == 0 else x.astype(np.float16).astype(np.float32)
            param.copy_(torch.from_numpy(np.ascontiguousarray(x)))
    return rounded


@pytest.mark.parametrize("name", list(CASES))
def test_converter_gguf_matches_transformers(converted, name):
    """The file's MLA sizes, routers, groups and correction biases read back into the decoder
    transformers' checkpoint describes. Q8_0: against transformers on the same rounded weights
    (the split ``kv_b_proj`` dequantized in float32: in float16 these random models' logits
    moved by 0.03)."""
    import gguf

    hf_model, path, error = converted[name]
    family, _, outtype = CASES[name]
    assert error is None, f"llama.cpp's converter failed on {name}: {error}"
    written = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    if family == "glm4_moe":
        assert "blk.3.nextn.eh_proj.weight" in written  # the MTP block is in the file
    else:  # kv_b_proj split per head
        assert {"blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight"} <= written and "blk.0.attn_kv_b.weight" not in written
    assert "blk.1.exp_probs_b.bias" in written or family == "deepseek_v2"
    ids = tokens()
    reference = converter_rounded(hf_model) if outtype == "q8_0" else hf_model
    with torch.no_grad():
        ref = reference(torch.tensor(ids[None])).logits[0].numpy()
    model, _ = load(path, dtype=mx.float32)
    assert model.args.router == ROUTERS[family]
    if family != "glm4_moe":  # attn_k_b/attn_v_b joined back into one float kv_b_proj
        assert type(model.layers[0].self_attn.kv_b_proj) is nn.Linear
    quantized = {n for n, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert bool(quantized) == (outtype == "q8_0")
    assert max_diff(np.array(model(mx.array(ids[None]))[0]), ref) <= BOUND
    assert not isinstance(model.layers[0].mlp, SparseMoE) and isinstance(model.layers[1].mlp, SparseMoE)
    biases = sum(b.numel() for n, b in hf_model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert footprint(path).parameters == sum(p.numel() for p in hf_model.parameters()) + biases  # ``info``'s count


@pytest.mark.parametrize("name", list(CASES))
def test_converted_gguf_loads_in_mlx_lm(converted, name, tmp_path):
    """``mlxformer convert`` of each llama.cpp-written GGUF (HF names: ``kv_b_proj`` joined
    back) loads in mlx-lm with mlxformer's logits on the GGUF."""
    from mlx_lm import load as mlx_lm_load

    _, path, error = converted[name]
    assert error is None, error
    convert(path, tmp_path / "mlx", progress=False)
    ids = mx.array(tokens()[None])
    ours, _ = load(path, dtype=mx.float32)
    theirs, _ = mlx_lm_load(str(tmp_path / "mlx"))
    theirs.set_dtype(mx.float32)
    assert max_diff(np.array(theirs(ids)[0]), np.array(ours(ids)[0])) <= 1e-4


def test_bad_routing_metadata_is_one_line(converted):
    """A gating function other than softmax/sigmoid, a non-bool renormalisation flag and more
    MTP blocks than blocks are one-line errors naming the key."""
    from mlxformer.errors import MlxformerError
    from mlxformer.formats.gguf import config_from_metadata
    from mlxformer.formats.gguf_reader import read_gguf

    _, path, _ = converted["deepseek_v3"]
    gguf = read_gguf(path)
    metadata, names = dict(gguf.metadata), set(gguf.tensors)
    assert config_from_metadata(metadata, names)["model_type"] == "deepseek_v3"
    for key, value, message in (("expert_gating_func", 3, "expert_gating_func 3 is not supported"),
                                ("expert_weights_norm", 1, "expert_weights_norm is not a bool"),
                                ("nextn_predict_layers", 3, "nextn_predict_layers 3 does not fit .*block_count 3")):
        with pytest.raises(MlxformerError, match=message):
            config_from_metadata({**metadata, f"deepseek2.{key}": value}, names)
