"""Hybrid Gated DeltaNet models (Qwen3.5 ``qwen35``, Qwen3.5-MoE ``qwen35moe``, Qwen3-Next
``qwen3next``) through the other formats: GGUFs written by llama.cpp's own
``convert_hf_to_gguf.py`` from tiny random transformers checkpoints (f32 and q8_0) against
transformers' logits on the original checkpoints; ``mlxformer convert`` output loaded by mlx-lm's
own ``qwen3_5``/``qwen3_5_moe``/``qwen3_next`` (float and 4-bit) with mlxformer's logits, and a
GGUF-sourced conversion too.

The checkpoints have 2 key heads and 4 value heads (so the converter reorders Qwen3.5's value
heads to its tiled order) of 12 and 10 features, 3 linear layers to 1 attention layer, and
SmolLM2's real tokenizer (a BPE whose hash llama.cpp's converter knows). For Qwen3.5-MoE the
converter's input says ``model_type: qwen3_5_text``: transformers builds its ``Qwen3_5Tokenizer``
for ``qwen3_5_moe_text`` whatever ``tokenizer_config.json`` names, whose pre-tokenizer hash over
SmolLM2's vocabulary llama.cpp does not know (the converter picks its class by ``architectures``).
llama.cpp's runtime cannot run these GGUFs (it requires key and value head dims to be equal).
"""

from __future__ import annotations

import copy
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch

from conftest import TINY_SHAPE, max_diff, write_byte_tokenizer, write_tiny_checkpoint
from test_gguf_families import run_converter
from test_hybrid import BOUND, CASES, HYBRID
from mlxformer import convert, load
from mlxformer.speculative.mtp import has_mtp_block

# name -> (model_type, converter --outtype); "-mtp": the checkpoint with an MTP layer, converted with it
GGUF_CASES = {
    "qwen3_5_text": ("qwen3_5_text", "f32"), "qwen3_5_moe_text": ("qwen3_5_moe_text", "f32"),
    "qwen3_next": ("qwen3_next", "f32"),
    "qwen3_5_text-q8_0": ("qwen3_5_text", "q8_0"), "qwen3_next-q8_0": ("qwen3_next", "q8_0"),
    "qwen3_5_text-mtp": ("qwen3_5_text", "f32"),
}
MLX_LM_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe", "qwen3_next": "qwen3_next"}
IDS = np.random.default_rng(1).integers(3, 256, size=150)  # three chunks of the parallel form


pytestmark = pytest.mark.usefixtures("cpu_module")


@pytest.fixture(scope="module")
def converted(tmp_path_factory, hf_smollm_tokenizer):
    """name -> (HF dir, transformers model, GGUF path, the converter's error or None)."""
    root = tmp_path_factory.mktemp("hybrid_formats")
    checkpoints, jobs = {}, []
    for model_type in CASES:
        directory, hf_model = write_tiny_checkpoint(root / model_type, model_type, **HYBRID, **CASES[model_type],
                                                    vocab_size=len(hf_smollm_tokenizer))
        hf_smollm_tokenizer.save_pretrained(directory)
        source = directory
        if model_type == "qwen3_5_moe_text":  # see the module docstring
            source = root / "converter_input_moe"
            shutil.copytree(directory, source)
            config = json.loads((source / "config.json").read_text())
            (source / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_5_text"}))
        checkpoints[model_type] = (directory, hf_model, source)
    mtp_source = with_mtp_layer(checkpoints["qwen3_5_text"][0], root / "with_mtp")
    for name, (model_type, outtype) in GGUF_CASES.items():
        source = mtp_source if name.endswith("-mtp") else checkpoints[model_type][2]
        flags = [] if name.endswith("-mtp") else ["--no-mtp"]
        argv = [str(source), "--outtype", outtype, *flags, "--outfile", str(root / f"{name}.gguf")]
        jobs.append({"name": name, "argv": argv})
    errors = run_converter(root, jobs)
    return {name: (*checkpoints[model_type][:2], root / f"{name}.gguf", errors[name])
            for name, (model_type, _) in GGUF_CASES.items()}


def with_mtp_layer(directory, out):
    """A copy of the Qwen3.5 checkpoint with a multi-token-prediction layer in the hub's names
    (``mtp.layers.0.*``: the attention layer's weights; ``mtp.fc``, its norms), which llama.cpp's
    converter appends as block 4 with ``nextn_predict_layers`` 1."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(directory, out)
    tensors = load_file(out / "model.safetensors")
    prefix = "model.layers.3."
    tensors.update({"mtp.layers.0." + k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
    hidden = TINY_SHAPE["hidden_size"]
    tensors["mtp.fc.weight"] = np.random.default_rng(0).standard_normal((hidden, 2 * hidden)).astype(np.float32)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = np.zeros(hidden, np.float32)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    return out


def reference(hf_model, ids: np.ndarray = IDS) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor(ids[None])).logits[0].numpy()


def stored_like_q8_0(hf_model):
    """A copy of ``hf_model`` with each matrix rounded as the converter's ``--outtype q8_0``
    stores it: Q8_0 (gguf-py's quantize/dequantize) where rows split into blocks of 32, else
    float16; the routers and the conv kept float32. (Rows are quantized alone, so the
    converter's row reorders do not change the rounding.)"""
    from gguf import GGMLQuantizationType, quants

    rounded = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, param in rounded.named_parameters():
            if param.ndim < 2 or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "conv1d.weight")):
                continue
            if param.shape[-1] % 32:
                param.copy_(param.half().float())
            else:
                values = quants.quantize(param.numpy(), GGMLQuantizationType.Q8_0)
                param.copy_(torch.from_numpy(quants.dequantize(values, GGMLQuantizationType.Q8_0)))
    return rounded


@pytest.mark.parametrize("name", list(GGUF_CASES))
def test_converter_gguf_matches_transformers(converted, name):
    """The GGUF's logits equal transformers' on the checkpoint it was made from (q8_0: on the
    same rounded weights). Every converter edit left in place moves them by O(1): ``-exp(A_log)``
    read as ``A_log``, the norms' added 1, Qwen3.5's tiled value heads, Qwen3-Next's split qkvz.
    A file with the MTP block loads the decoder without it (its head: ``--mtp``, tests/test_mtp_gguf.py)."""
    _, hf_model, path, error = converted[name]
    assert error is None, f"llama.cpp's converter failed on {name}: {error}"
    assert has_mtp_block(path) == name.endswith("-mtp")
    if name.endswith("q8_0"):
        hf_model = stored_like_q8_0(hf_model)
    model, _ = load(path, dtype=mx.float32, threads=1)
    assert [layer.mixer_name for layer in model.layers] == ["linear_attn"] * 3 + ["self_attn"]
    assert max_diff(np.array(model(mx.array(IDS[None]))[0]), reference(hf_model)) <= BOUND


@pytest.mark.parametrize("model_type", list(CASES))
def test_mlxformer_conversions_load_in_mlx_lm(model_type, tmp_path):
    """``convert`` of each HF checkpoint (float, and 4-bit): mlx-lm's own model class loads it,
    with mlxformer's logits on the same dir; the float one equals transformers, and both read
    back in mlxformer in mlx-lm's layout (conv ``(C, K, 1)``, norms without offset)."""
    from mlx_lm import load as mlx_lm_load

    directory, hf_model = write_tiny_checkpoint(tmp_path / "hf", model_type, **HYBRID, **CASES[model_type])
    write_byte_tokenizer(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    ids = IDS[:40]
    for quantize in (False, True):
        out = tmp_path / ("q4" if quantize else "float")
        convert(directory, out, progress=False, **(dict(quantize=True, q_bits=4, q_group_size=32) if quantize else {}))
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == MLX_LM_TYPES[model_type] and "text_config" not in config
        theirs, _ = mlx_lm_load(str(out))
        theirs.set_dtype(mx.float32)
        ours, _ = load(out, dtype=mx.float32, threads=1)
        assert ours.args.linear_conv_channels_last and ours.args.norm_offset == 0.0
        got = np.array(ours(mx.array(ids[None]))[0])
        assert max_diff(np.array(theirs(mx.array(ids[None]))[0]), got) <= 1e-3, quantize  # measured <= 2.7e-4
        if not quantize:
            assert max_diff(got, reference(hf_model, ids)) <= BOUND


def test_gguf_sourced_conversion_loads_in_mlx_lm(converted, tmp_path):
    """A Qwen3-Next GGUF (llama.cpp's layout) converted to an MLX dir: mlx-lm's ``qwen3_next``
    (fused ``in_proj_qkvz``, its conv and norm layout, ``full_attention_interval``) gives
    mlxformer's logits on the GGUF, and transformers'."""
    from mlx_lm import load as mlx_lm_load

    _, hf_model, path, _ = converted["qwen3_next"]
    convert(path, tmp_path / "mlx", progress=False)
    config = json.loads((tmp_path / "mlx" / "config.json").read_text())
    assert config["model_type"] == "qwen3_next" and config["full_attention_interval"] == 4
    ids = IDS[:40]
    ours, _ = load(path, dtype=mx.float32, threads=1)
    theirs, _ = mlx_lm_load(str(tmp_path / "mlx"))
    theirs.set_dtype(mx.float32)
    got = np.array(theirs(mx.array(ids[None]))[0])
    assert max_diff(got, np.array(ours(mx.array(ids[None]))[0])) <= 1e-3
    assert max_diff(got, reference(hf_model, ids)) <= BOUND


def test_qwen3_next_gguf_with_mixed_types_fuses_in_float(converted, tmp_path):
    """llama.cpp's own quantizer (Q3_K_M mix) stores ``attn_qkv`` as Q5_1 and ``attn_gate`` as
    Q4_0 here: ``in_proj_qkvz`` is fused from both dequantized (a float layer, the others
    quantized), each row within its quantization error of transformers' row (rows from the
    wrong head differ by O(1))."""
    import ctypes

    import llama_cpp

    from mlxformer.formats.checkpoint import open_checkpoint
    from mlxformer.formats.gguf_reader import read_gguf

    _, hf_model, path, _ = converted["qwen3_next"]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q3_K_M, 1
    out = tmp_path / "q3_k_m.gguf"
    assert llama_cpp.llama_model_quantize(str(path).encode(), str(out).encode(), ctypes.byref(params)) == 0
    types = {name: info.type_name for name, info in read_gguf(out).tensors.items()}
    assert types["blk.0.attn_qkv.weight"] != types["blk.0.attn_gate.weight"]
    checkpoint = open_checkpoint(out)
    fused = np.array(checkpoint.tensors["model.layers.0.linear_attn.in_proj_qkvz.weight"])
    expected = hf_model.model.layers[0].linear_attn.in_proj_qkvz.weight.detach().numpy()
    assert (np.abs(fused - expected).max(1) / np.abs(expected).max(1)).max() < 0.2  # measured 0.12
    model, _ = load(out, dtype=mx.float32, threads=1)
    mixer = model.layers[0].linear_attn
    assert type(mixer.in_proj_qkvz).__name__ == "Linear" and type(mixer.in_proj_ba).__name__ == "QuantizedLinear"
    assert np.all(np.isfinite(np.array(model(mx.array(IDS[None, :8])))))
