"""The GPU plan, run on the CPU: every family's tiny checkpoint and the real Gemma 3 270M GGUF
load as a GPU would load them (16-bit, never float16 where it overflows; no CPU streams) and
give finite logits and float32's greedy tokens; the float16 rule (family and probe), the
converter's default dtype, ``info``'s plan lines and Metal's wired limit."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from conftest import write_byte_tokenizer, write_tiny_checkpoint
from mlxformer import load
from mlxformer.models.device_plan import DevicePlan, wire_memory
from mlxformer.models.dtype_policy import apply_dtype_policy, cast_floating, floating_dtypes
from mlxformer.models.row_sharding import RowSharded
from test_families import CASES, tokens
from test_gemma3_real import REFERENCE, gemma3_path  # noqa: F401 (the fixture)

FAMILIES = {"llama": ("llama", {}), "qwen2": ("qwen2", {}), **CASES}


pytestmark = pytest.mark.usefixtures("cpu_module")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gpu_plan_on_the_cpu_for_every_family(family, tmp_path):
    """bfloat16 rounding moves tiny random models' logits (perturbed weights; Gemma 2's soft cap
    leaves top-2 gaps of hundredths), so the bound is transformers' own: our bfloat16 logits are
    as close to float32's as transformers' bfloat16 logits are, and their argmax agrees as often."""
    import torch

    model_type, overrides = FAMILIES[family]
    directory, hf_model = write_tiny_checkpoint(tmp_path, model_type, **overrides)
    write_byte_tokenizer(directory)
    model, _ = load(directory, plan=DevicePlan("gpu"))
    assert set(floating_dtypes(model)) == {mx.bfloat16}  # a float32 checkpoint computes in bfloat16 on a GPU
    assert not any(isinstance(m, RowSharded) for _, m in model.named_modules())  # no CPU streams
    ids = tokens(24)
    got = model(mx.array(ids[None]))[0]
    assert got.dtype == mx.bfloat16 and bool(mx.isfinite(got).all())
    with torch.no_grad():
        want = hf_model(torch.tensor(ids[None])).logits[0].numpy()
        hf_bf16 = hf_model.to(torch.bfloat16)(torch.tensor(ids[None])).logits[0].float().numpy()
    ours = np.array(got.astype(mx.float32))
    ours_error, hf_error = np.abs(ours - want).max(), np.abs(hf_bf16 - want).max()
    assert ours_error <= 1.5 * hf_error + 0.05, (ours_error, hf_error)
    agree = (ours.argmax(-1) == want.argmax(-1)).mean()
    assert agree >= (hf_bf16.argmax(-1) == want.argmax(-1)).mean() - 2 / len(ids), agree


@pytest.mark.parametrize("model_type, expected", [("llama", mx.float16), ("gemma3_text", mx.bfloat16)])
def test_a_float16_checkpoint_keeps_float16_on_a_gpu_unless_its_family_overflows(model_type, expected, tmp_path):
    extra = dict(head_dim=32, sliding_window=8, query_pre_attn_scalar=16) if model_type == "gemma3_text" else {}
    directory, _ = write_tiny_checkpoint(tmp_path, model_type, **extra)
    write_byte_tokenizer(directory)
    model, _ = load(directory, dtype=mx.float16)  # as a float16 checkpoint would hold it
    assert apply_dtype_policy(model, None, mx.DeviceType.gpu).compute == expected
    assert set(floating_dtypes(model)) == {expected}


def test_the_load_probe_moves_an_overflowing_float16_model_to_bfloat16(tmp_path):
    """A llama whose logits pass 65,504 (a final norm weight of 30,000, finite in float16): its
    float16 logits are not finite, so the GPU plan computes it in bfloat16."""
    directory, _ = write_tiny_checkpoint(tmp_path, "llama")
    write_byte_tokenizer(directory)
    model, _ = load(directory, dtype=mx.float32)
    model.model.norm.weight = mx.full(model.model.norm.weight.shape, 3e4)
    cast_floating(model, mx.float16)  # a float16 checkpoint
    ids = mx.array(tokens(8)[None])
    assert not bool(mx.isfinite(model(ids)).all())
    assert apply_dtype_policy(model, None, mx.DeviceType.gpu).compute == mx.bfloat16
    assert bool(mx.isfinite(model(ids)).all())


# bfloat16's measured effect on this model's logits, teacher forced over transformers' 24 greedy
# tokens (float32 logits ~22): the largest logit of a step moves by 1.5-3.5, and the gap between
# float32's top two tokens by at most 1.92 (median 0.34; 1.76 before the Gemma norms' scale was
# computed in float32: noise); a float32 residual stream (tried, not kept) gave 1.30. So it is
# bfloat16's rounding of the weights (the GGUF's float16 scales) and activations. Steps whose
# float32 top-2 gap is wider than this bound must keep float32's token; 19 of the 24 are
# narrower (near ties: 4 to 7 of them change token, all with gaps under 0.55).
BF16_GAP_ERROR = 2.0


def test_gemma3_270m_gguf_gpu_plan_on_the_cpu(gemma3_path):  # noqa: F811
    """The Q4_K_M GGUF's scales are float16, which the old GPU rule computed in: its residual
    reaches ~103,800, past float16's range (non-finite logits). The GPU plan computes in
    bfloat16: finite logits; teacher forced over transformers' greedy continuation (which our
    float32 gives, ``test_gemma3_real``), the gap between float32's top two tokens moves by
    less than ``BF16_GAP_ERROR``, and every step whose gap is wider keeps float32's token."""
    model, _ = load(gemma3_path, plan=DevicePlan("gpu"))
    dtypes = floating_dtypes(model)
    assert mx.float16 not in dtypes and max(dtypes, key=dtypes.__getitem__) == mx.bfloat16
    prompt, greedy = REFERENCE["ids"], REFERENCE["greedy"][:16]  # (bfloat16 quantized matmuls are slow on the CPU)
    ids = mx.array([prompt + greedy])
    logits = model(ids)[0, len(prompt) - 1 : -1]  # (16, vocab): the predictions of the greedy tokens
    assert bool(mx.isfinite(logits).all())
    got = np.array(logits.astype(mx.float32))
    f32, _ = load(gemma3_path, dtype=mx.float32)
    want = np.array(f32(ids)[0, len(prompt) - 1 : -1])
    assert (want.argmax(-1) == np.array(greedy)).all()  # float32 is transformers' greedy
    rows = np.arange(len(greedy))
    second, first = np.argsort(want, axis=-1)[:, -2:].T
    gap, gap_bf16 = want[rows, first] - want[rows, second], got[rows, first] - got[rows, second]
    assert np.abs(gap_bf16 - gap).max() < BF16_GAP_ERROR, np.abs(gap_bf16 - gap).round(2).tolist()
    clear = gap > BF16_GAP_ERROR
    assert clear.sum() >= 3 and (got.argmax(-1)[clear] == first[clear]).all(), (gap.round(2).tolist(), got.argmax(-1))
    forced, _ = load(gemma3_path, dtype=mx.float16)  # what float16 gives: the rule matters
    assert not bool(mx.isfinite(forced(mx.array([prompt]))).all())


def test_convert_never_defaults_to_float16_for_a_family_that_overflows():
    from mlxformer.tools.converter import default_float_dtype

    assert default_float_dtype(True, "llama", {mx.float32}) == mx.float16
    assert default_float_dtype(False, "llama", {mx.float16}) is None  # keeps the source's
    assert default_float_dtype(True, "gemma3_text", {mx.float32}) == mx.bfloat16
    assert default_float_dtype(False, "gemma2", {mx.float16, mx.float32}) == mx.bfloat16
    assert default_float_dtype(False, "gemma", {mx.float32}) is None


def test_info_prints_each_device_plan(smollm_gguf, capsys):
    from mlxformer.cli.main import main

    assert main(["info", "--model", str(smollm_gguf), "--device-plan", "gpu"]) == 0
    out = capsys.readouterr().out
    assert "as loaded here" in out and "(float16 compute)" in out  # the GPU plan's sizes
    lines = out.split("device plans:")[1].strip().splitlines()
    assert lines[0].split()[:2] == ["gpu", "float16"] and "prefill chunks of 512" in lines[0]
    assert lines[1].split()[:2] == ["cpu", "float32"] and "(this device)" in lines[1]


def test_wired_limit_is_set_on_metal_only(monkeypatch):
    calls = []
    monkeypatch.setattr(mx, "set_wired_limit", lambda limit: calls.append(limit))
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    assert wire_memory() is None and calls == []
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx.metal, "device_info", lambda: {"max_recommended_working_set_size": 123456})
    assert wire_memory() == 123456 and calls == [123456]


def test_gemma_norm_scales_in_float32_as_transformers():
    """Gemma's ``(1 + weight)`` norm on bfloat16 activations: the scale and the product in
    float32, then rounded once (transformers' ``Gemma3RMSNorm``); in bfloat16, ``1 + weight``
    alone kept 8 bits (up to 0.4% off on every channel)."""
    import torch
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from mlxformer.models.norms import RMSNorm

    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((4, 256)).astype(np.float32), (rng.standard_normal(256) * 0.05).astype(np.float32)
    ref = Gemma3RMSNorm(256, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(torch.tensor(w))
        want = ref(torch.tensor(x).to(torch.bfloat16)).float().numpy()
    norm = RMSNorm(256, eps=1e-6, offset=1.0)
    norm.weight = mx.array(w).astype(mx.bfloat16)
    got = np.array(norm(mx.array(x).astype(mx.bfloat16)).astype(mx.float32))
    ulp = np.abs(want) * 2.0**-8  # one bfloat16 step
    assert (np.abs(got - want) <= ulp + 1e-6).all(), np.abs(got - want).max()
