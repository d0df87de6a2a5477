"""Converted outputs against transformers' float32 forward of the *source* checkpoint (not
only mlx-lm reading the same output).

- Float outputs: float32 must give the source's logits (tolerance: float32 rounding), and
  bfloat16 the logits of the source with its weights rounded to bfloat16 by torch.
- Quantized outputs: the logits differ from the source's by the quantization error, so the
  bound is relative to it: at most 10% above the error of plain round-to-nearest min/max
  quantization (written here in numpy) at the same bits and group sizes, the baseline any
  affine quantizer should reach (this tiny random model is sensitive: 4-bit weights move its
  logits by ~40% of their RMS); 8-bit within 5% of the logits' RMS.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from conftest import write_byte_tokenizer, write_tiny_checkpoint
from mlxformer import convert, load

# text tokens (the byte tokenizer's ids) of tests/data/eval.txt, not the calibration text
EVAL_TEXT = Path(__file__).resolve().parent / "data/eval.txt"
TOKENS = [b for b in EVAL_TEXT.read_text(encoding="utf-8").encode("latin-1", "replace")[:128]]


@pytest.fixture(scope="module", params=[("llama", True), ("qwen2", False)], ids=["llama-tied", "qwen2-biases"])
def source(request, tmp_path_factory):
    model_type, tied = request.param
    directory, hf_model = write_tiny_checkpoint(tmp_path_factory.mktemp(model_type), model_type, seed=9,
                                                tie_word_embeddings=tied)
    write_byte_tokenizer(directory)  # calibration text within the 256-token vocabulary
    return directory, hf_model


def torch_logits(hf_model) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf_model(torch.tensor([TOKENS])).logits[0].double().numpy()


def our_logits(directory) -> np.ndarray:
    model, _ = load(directory, dtype=mx.float32)
    return np.array(model(mx.array([TOKENS]))[0].astype(mx.float32)).astype(np.float64)


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x))))


def rtn(weight: np.ndarray, bits: int, group_size: int) -> np.ndarray:
    """Textbook affine round-to-nearest: per group, min/max mapped onto codes 0..2**bits - 1."""
    rows, cols = weight.shape
    groups = weight.reshape(rows, cols // group_size, group_size)  # (rows, groups, g)
    lo, hi = groups.min(-1, keepdims=True), groups.max(-1, keepdims=True)
    scale = np.maximum(hi - lo, 1e-12) / (2**bits - 1)
    codes = np.clip(np.round((groups - lo) / scale), 0, 2**bits - 1)
    return (codes * scale + lo).reshape(rows, cols)


def rtn_model(hf_model, quantization: dict):
    """A copy of ``hf_model`` whose quantized matrices (per the output's config) are RTN-rounded."""
    import torch

    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                continue
            path = "model.embed_tokens" if name == "lm_head" and model.config.tie_word_embeddings else name
            spec = quantization.get(path, quantization)
            weight = module.weight.double().numpy()
            module.weight.copy_(torch.from_numpy(rtn(weight, int(spec["bits"]), int(spec["group_size"]))))
    return model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_float_output_gives_the_source_logits(source, tmp_path, dtype):
    import torch

    directory, hf_model = source
    out = convert(directory, tmp_path / "out", dtype=dtype, progress=False)
    reference = copy.deepcopy(hf_model)
    if dtype == "bfloat16":
        with torch.no_grad():
            for param in reference.parameters():
                param.copy_(param.to(torch.bfloat16).float())
        assert rms(torch_logits(reference) - torch_logits(hf_model)) > 1e-3  # the rounding is visible
    np.testing.assert_allclose(our_logits(out), torch_logits(reference), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("kwargs", [{}, {"q_bits": 8}, {"q_bits": 3, "quant_recipe": "mixed_6"}],
                         ids=["default-mixed-4bit", "8bit", "3bit-mixed_6"])
def test_quantized_output_error_against_the_source(source, tmp_path, kwargs):
    directory, hf_model = source
    out = convert(directory, tmp_path / "out", quantize=True, progress=False, **kwargs)
    quantization = json.loads((out / "config.json").read_text())["quantization"]
    expected = torch_logits(hf_model)
    ours = rms(our_logits(out) - expected)
    baseline = rms(torch_logits(rtn_model(hf_model, quantization)) - expected)
    print(f"\n{kwargs}: logit RMS error vs source: ours {ours:.4f}, round-to-nearest {baseline:.4f}, "
          f"logit RMS {rms(expected):.3f}")
    # The search minimizes the (importance-weighted) weight error, not this text's logit error:
    # it beats round-to-nearest in expectation, by up to 12% here, and trails it by at most 2%
    # on some (model, bits) pairs; 10% slack. A mis-packed or misread matrix costs errors of
    # the order of the logits themselves, far above the bound.
    assert 0 < ours <= 1.1 * baseline, (ours, baseline)
    if kwargs.get("q_bits") == 8:
        assert ours < 0.05 * rms(expected)
