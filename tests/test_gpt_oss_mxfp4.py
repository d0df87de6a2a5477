"""gpt-oss's experts in MXFP4 as the hub publishes them (``*_blocks`` + ``*_scales`` uint8,
``quantization_config.quant_method: mxfp4``), loaded into MLX's own ``mxfp4`` quantization
without a pass through float.

The blocks are written here by an encoder written from the OCP Microscaling spec (E2M1 codes,
two a byte, low nibble first; one E8M0 exponent per 32 values); transformers' own MXFP4
dequantizer (``integrations.mxfp4.convert_moe_packed_tensors``) gives the reference weights,
which are put into the transformers model whose logits ours must equal.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch

from conftest import cpu_default_device, max_diff
from mlxformer import load
from mlxformer.models.moe import QuantizedSwitchLinear
from test_gpt_oss import BOUND, SEQ_LEN, reference, tokens, write_gpt_oss

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def encode_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w`` ``(..., out, in)`` -> blocks ``(..., out, in / 32, 16)`` and scales ``(..., out, in / 32)``:
    per 32 values the exponent ``floor(log2(amax)) - 2`` (E2M1's largest is 1.5 * 2**2), stored
    biased by 127, and each value's nearest E2M1 code (sign in bit 3)."""
    groups = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = np.abs(groups).max(axis=-1)
    exponent = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-30))) - 2, -127).clip(-127, 127)
    scaled = groups / np.exp2(exponent)[..., None]
    codes = np.abs(np.abs(scaled)[..., None] - E2M1).argmin(axis=-1) | ((scaled < 0) << 3)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (exponent + 127).astype(np.uint8)


def to_mxfp4_checkpoint(directory, hf_model) -> dict:
    """Rewrite the checkpoint in ``directory`` with its experts as the hub's MXFP4 blocks and
    scales, and put transformers' dequantization of them into ``hf_model``; returns, per fused
    name, ``(blocks, scales, dequantized (E, in, out))``."""
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(directory / "model.safetensors")
    params = dict(hf_model.named_parameters())
    packed = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # HF's parameter is (E, in, out); the hub stores (E, out, in / 32, 16) blocks
        blocks, scales = encode_mxfp4(np.ascontiguousarray(tensors.pop(name).swapaxes(-1, -2)))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        dequantized = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                 dtype=torch.float32)
        with torch.no_grad():
            params[name].copy_(dequantized)
        packed[name] = (blocks, scales, dequantized.numpy())
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config))
    return packed


@pytest.fixture(scope="module")
def mxfp4_case(tmp_path_factory):
    """The tiny checkpoint rewritten with MXFP4 experts, and the transformers model holding
    transformers' dequantization of them."""
    with cpu_default_device():
        directory, hf_model = write_gpt_oss(tmp_path_factory.mktemp("gpt_oss_mxfp4"))
        packed = to_mxfp4_checkpoint(directory, hf_model)
        model, tokenizer = load(directory, dtype=mx.float32, threads=1)
        yield directory, model, hf_model, packed


def test_blocks_load_as_mlx_mxfp4_bit_exact(mxfp4_case):
    """The experts are MLX mxfp4 layers whose ``mx.dequantize`` is transformers' dequantization,
    bit for bit (gate rows even, up rows odd of the fused matrix)."""
    _, model, _, packed = mxfp4_case
    for i, layer in enumerate(model.layers):
        experts = layer.mlp.experts
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert isinstance(experts[proj], QuantizedSwitchLinear) and experts[proj].mode == "mxfp4"
            assert experts[proj].weight.dtype == mx.uint32 and experts[proj].scales.dtype == mx.uint8
        fused = f"model.layers.{i}.mlp.experts."
        gate_up = packed[fused + "gate_up_proj"][2].swapaxes(-1, -2)  # (E, 2 * inter, hidden)
        down = packed[fused + "down_proj"][2].swapaxes(-1, -2)  # (E, hidden, inter)
        for proj, want in (("gate_proj", gate_up[:, 0::2]), ("up_proj", gate_up[:, 1::2]), ("down_proj", down)):
            layer_ = experts[proj]
            got = mx.dequantize(layer_.weight, layer_.scales, None, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
            assert np.array_equal(np.array(got), want), (i, proj)


def test_logits_match_transformers_on_the_dequantized_reference(mxfp4_case):
    _, model, hf_model, _ = mxfp4_case
    ids = tokens(SEQ_LEN)
    assert max_diff(np.array(model(mx.array(ids[None]))[0]), reference(hf_model, ids)) <= BOUND
    short = tokens(10, seed=3)  # the unsorted gather of decode-sized inputs
    assert max_diff(np.array(model(mx.array(short[None]))[0]), reference(hf_model, short)) <= BOUND


def mlx_lm_pair(directory, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """mlx-lm's logits and ours on ``directory`` with YaRN's ramp ends rounded (``truncate``
    true: mlx-lm's YarnRoPE always rounds them, transformers and gpt-oss's config do not)."""
    from mlx_lm.utils import load_model

    from conftest import edit_config

    config = json.loads((directory / "config.json").read_text())
    edit_config(directory, rope_parameters={**config["rope_parameters"], "truncate": True},
                rope_scaling={**config["rope_scaling"], "truncate": True})
    theirs = np.array(load_model(directory)[0](mx.array(ids[None]))[0].astype(mx.float32))
    return theirs, np.array(load(directory, dtype=mx.float32, threads=1)[0](mx.array(ids[None]))[0])


def test_converted_mlx_dirs_load_here_and_in_mlx_lm(mxfp4_case, tmp_path):
    """``convert`` keeps the hub's MXFP4 experts packed (the mlx-community layout: split
    gate/up, ``quantization`` with mode mxfp4) and ``-q --quant-recipe mxfp4`` writes every
    matrix as mxfp4: both load here and in mlx-lm (its gpt_oss model) with the same logits."""
    from mlxformer import convert
    from mlxformer.formats.safetensors import read_safetensors_header

    directory, model, hf_model, _ = mxfp4_case
    ids = tokens(SEQ_LEN)
    with cpu_default_device():
        kept = convert(directory, tmp_path / "kept", dtype="float32", progress=False)
        config = json.loads((kept / "config.json").read_text())
        assert config["quantization"]["mode"] == "mxfp4" and config["quantization"]["group_size"] == 32
        header, _ = read_safetensors_header(kept / "model.safetensors")
        assert header["model.layers.0.mlp.experts.gate_proj.scales"][1] == mx.uint8
        assert "model.layers.0.mlp.experts.gate_proj.biases" not in header
        ours = np.array(load(kept, dtype=mx.float32, threads=1)[0](mx.array(ids[None]))[0])
        assert np.array_equal(ours, np.array(model(mx.array(ids[None]))[0]))
        assert max_diff(*mlx_lm_pair(kept, ids)) <= BOUND
        # ``info``: the packed bytes as stored, the parameters unpacked, 2 of 6 experts active a token
        from mlxformer.tools.planning import footprint

        fp = footprint(kept)
        assert fp.stored_bytes == (kept / "model.safetensors").stat().st_size - 8 - int.from_bytes(
            (kept / "model.safetensors").read_bytes()[:8], "little")
        routed = sum(int(np.prod(t.shape)) for t in fp.tensors if ".mlp.experts." in t.name)
        assert routed == 3 * 6 * (3 * 96 * 64 + 2 * 96 + 64)  # 3 layers of 6 experts: weights and biases
        assert fp.active_parameters == fp.parameters - routed + routed * 2 // 6

        requantized = convert(directory, tmp_path / "mxfp4", quantize=True, quant_recipe="mxfp4", dequantize=True,
                              dtype="float32", progress=False)
        config = json.loads((requantized / "config.json").read_text())
        assert config["quantization"] == {"mode": "mxfp4", "group_size": 32, "bits": 4} | {
            k: v for k, v in config["quantization"].items() if k not in ("mode", "group_size", "bits")}
        loaded = load(requantized, dtype=mx.float32, threads=1)[0]
        assert loaded.layers[0].self_attn.q_proj.mode == "mxfp4"
        assert max_diff(*mlx_lm_pair(requantized, ids)) <= BOUND
