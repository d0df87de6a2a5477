"""``mlxformer info``: its figures, read from headers only, match the loaded model and a filled cache."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from conftest import write_tiny_checkpoint


def loaded_parameter_count(model: nn.Module) -> int:
    """Weights of a loaded model, quantized ones unpacked (scales and biases are not weights)."""
    total = 0
    for _, module in model.named_modules():
        quantized = isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        for name, value in tree_flatten(module.parameters()):
            if "." in name:
                continue  # counted by the child module
            if quantized and name in ("scales", "biases"):
                continue
            total += value.size * 32 // module.bits if quantized and name == "weight" else value.size
    return total


@pytest.mark.parametrize("model_type, extra", [("llama", {"head_dim": 64}), ("qwen3", {"head_dim": 64, "tie_word_embeddings": False}),
                                               ("gemma3_text", {"head_dim": 64, "sliding_window": 16})])
def test_counts_and_kv_bytes_match_loaded_model(tmp_path, cpu_device, model_type, extra):
    from mlxformer.cache import CacheSettings, make_cache
    from mlxformer.generation.stream import prefill
    from mlxformer.loader import build_model, read_checkpoint
    from mlxformer.tools.planning import footprint

    directory, hf_model = write_tiny_checkpoint(tmp_path, model_type, **extra)
    fp = footprint(directory)
    config, weights, _ = read_checkpoint(directory)
    model = build_model(config, weights)
    assert fp.parameters == loaded_parameter_count(model) == hf_model.num_parameters()
    a = fp.args
    assert fp.estimate == 12 * a.num_hidden_layers * a.hidden_size**2 + a.vocab_size * a.hidden_size * (
        1 if a.tie_word_embeddings else 2
    )
    tokens = mx.array([i % 200 for i in range(300)])
    for bits, group in ((None, 64), (8, 64), (4, 32)):
        cache = make_cache(model, CacheSettings(kv_bits=bits, kv_group_size=group))
        prefill(model, tokens, cache)
        mx.eval([c.state for c in cache])
        assert fp.kv_bytes(300, bits, group) == sum(c.nbytes for c in cache), bits


def test_gguf_counts_from_header_only(smollm_gguf, cpu_device, monkeypatch):
    from mlxformer.formats import gguf
    from mlxformer.loader import build_model, load, read_checkpoint
    from mlxformer.tools.planning import footprint

    with monkeypatch.context() as patch:  # headers only: no tensor is decoded
        patch.setattr(gguf, "_decode", lambda *a: pytest.fail("footprint decoded a tensor"))
        fp = footprint(smollm_gguf)
    config, weights, _ = read_checkpoint(smollm_gguf)
    stored = build_model(config, weights)
    assert fp.stored_bytes == sum(v.nbytes for _, v in tree_flatten(stored.parameters()))
    assert fp.parameters == loaded_parameter_count(stored)
    assert fp.weight_bytes(32) == 4 * fp.parameters
    # Issue 17, defect 11: on the CPU the quantized embedding's float16 scales are loaded as
    # float32 (101.89 MB, not the 98.35 MB stored): the figure is what ``load`` holds.
    loaded, _ = load(smollm_gguf, threads=1)
    assert fp.loaded_bytes == sum(v.nbytes for _, v in tree_flatten(loaded.parameters())) > fp.stored_bytes
    assert fp.activation_bytes == 4


def test_float32_checkpoint_planned_in_the_dtype_each_device_computes(tmp_path):
    """Issue 17, defect 11: a float32 checkpoint computes in bfloat16 on a GPU (the load policy),
    so its weights and float KV cache take half the bytes they take on the CPU."""
    from mlxformer.tools.planning import footprint

    directory, hf_model = write_tiny_checkpoint(tmp_path, "llama")
    cpu = footprint(directory, device=mx.DeviceType.cpu)
    gpu = footprint(directory, device=mx.DeviceType.gpu)
    params = hf_model.num_parameters()
    assert cpu.stored_bytes == gpu.stored_bytes == cpu.loaded_bytes == 4 * params
    assert gpu.loaded_bytes == 2 * params and gpu.plan.compute == mx.bfloat16
    assert cpu.kv_bytes_per_token() == 2 * gpu.kv_bytes_per_token()


def test_info_cli(smollm_gguf):
    out = subprocess.run(
        [sys.executable, "-m", "mlxformer", "info", "--model", str(smollm_gguf), "--context", "1000"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "134,515,008 exact" in out.stdout  # SmolLM2-135M's published parameter count
    assert "fits on this machine" in out.stdout
