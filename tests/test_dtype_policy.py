"""The compute dtype policy on both device kinds (decided without a GPU), and what ``load`` applies.

Defect 11: on Metal a GGUF's F32 norm weights promoted the activations and the KV cache of a
16-bit quantized model to float32. The GPU decision must be 16-bit and, once applied, the
activations, the KV cache and the logits must be 16-bit (checked here by running the applied
GPU plan on the CPU device, on a tiny model shaped like a GGUF: float16 scales, F32 norms).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from conftest import cpu_default_device, write_tiny_byte_llama, write_tiny_checkpoint
from mlxformer.cache import make_cache
from mlxformer.loader import build_model, load, read_checkpoint
from mlxformer.models.dtype_policy import DtypePlan, cast_floating, decide_dtype, floating_dtypes, is_quantized

CPU, GPU = mx.DeviceType.cpu, mx.DeviceType.gpu
F16, BF16, F32 = mx.float16, mx.bfloat16, mx.float32
# element counts of the floating arrays of typical checkpoints
GGUF_Q4 = {F16: 9_000_000, F32: 20_000}  # quantized: float16 scales/biases, F32 norms
GGUF_F16 = {F16: 134_000_000, F32: 20_000}  # float16 weights, F32 norms
MLX_4BIT_BF16 = {BF16: 9_000_000}
SAFETENSORS_BF16 = {BF16: 134_000_000}
SAFETENSORS_F32 = {F32: 134_000_000}


@pytest.mark.parametrize(
    "device,dtypes,quantized,requested,expected",
    [
        # GPU: 16-bit activations and KV cache, the checkpoint's own 16-bit dtype where it has one
        (GPU, GGUF_Q4, True, None, DtypePlan(F16)),
        (GPU, GGUF_F16, False, None, DtypePlan(F16)),
        (GPU, MLX_4BIT_BF16, True, None, DtypePlan(BF16)),
        (GPU, SAFETENSORS_BF16, False, None, DtypePlan(BF16)),
        (GPU, SAFETENSORS_F32, False, None, DtypePlan(BF16)),  # no 16-bit array: bfloat16's range
        (GPU, GGUF_Q4, True, F32, DtypePlan(F32)),  # an explicit request wins
        # CPU: quantized models compute in float32 with their linear layers' scales as stored
        (CPU, GGUF_Q4, True, None, DtypePlan(F32, keep_quantized_linear_scales=True)),
        (CPU, MLX_4BIT_BF16, True, None, DtypePlan(F32, keep_quantized_linear_scales=True)),
        (CPU, SAFETENSORS_BF16, False, None, DtypePlan(BF16)),
        (CPU, SAFETENSORS_F32, False, None, DtypePlan(F32)),
        (CPU, GGUF_F16, False, None, DtypePlan(F32)),  # mixed: what promotion gives, cast once
        (CPU, GGUF_Q4, True, F16, DtypePlan(F16)),
    ],
)
def test_decisions(device, dtypes, quantized, requested, expected):
    assert decide_dtype(device, dtypes, quantized, requested) == expected


def gguf_like_tiny_model(tmp_path):
    """A tiny 4-bit llama stored like a Q4 GGUF: float16 scales/biases, F32 norms, quantized embedding."""
    directory, _ = write_tiny_checkpoint(tmp_path, "llama", tie_word_embeddings=True, head_dim=32)
    config, weights, _ = read_checkpoint(directory)
    model = build_model(config, weights)
    model.set_dtype(F32)
    nn.quantize(model, group_size=32, bits=4)
    for _, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            module.update({"scales": module.scales.astype(F16), "biases": module.biases.astype(F16)})
    return model


def test_gpu_plan_makes_activations_and_kv_cache_16_bit(tmp_path):
    """Applying the GPU decision to a GGUF-shaped model: 16-bit KV cache and logits, logits close
    to the float32 computation. (Run on the CPU device: the plan's effect does not depend on it.)"""
    with cpu_default_device():
        model = gguf_like_tiny_model(tmp_path)
        ids = mx.array(np.random.default_rng(0).integers(0, 256, size=(1, 12)))
        promoted_cache = make_cache(model)
        reference = model(ids, promoted_cache)  # as stored: the F32 norms promote everything
        assert reference.dtype == F32 and promoted_cache[0].state[0].dtype == F32

        plan = decide_dtype(GPU, floating_dtypes(model), is_quantized(model), None)
        assert plan == DtypePlan(F16)
        cast_floating(model, plan.compute, plan.keep_quantized_linear_scales)
        cache = make_cache(model)
        logits = model(ids, cache)
        assert logits.dtype == F16
        assert all(c.state[0].dtype == F16 and c.state[1].dtype == F16 for c in cache)
        assert model.model.norm.weight.dtype == F16
        error = float(mx.abs(logits.astype(F32) - reference).max()) / float(mx.abs(reference).max())
        assert error < 0.02


def test_load_applies_the_cpu_decision(smollm_gguf):
    """On the CPU device ``load`` casts exactly as ``decide_dtype`` says for the checkpoint."""
    with cpu_default_device():
        config, weights, _ = read_checkpoint(smollm_gguf)
        stored = build_model(config, weights)
        plan = decide_dtype(CPU, floating_dtypes(stored), is_quantized(stored), None)
        assert plan == DtypePlan(F32, keep_quantized_linear_scales=True)
        model, _ = load(smollm_gguf, threads=1)
        stored_modules = dict(stored.named_modules())
        for path, module in model.named_modules():
            for name, value in module.items():
                if not (isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating)):
                    continue
                if isinstance(module, nn.QuantizedLinear):  # scales/biases as stored
                    assert value.dtype == stored_modules[path][name].dtype == F16, f"{path}.{name}"
                else:
                    assert value.dtype == F32, f"{path}.{name}"
        cache = make_cache(model)
        assert model(mx.array([[1, 2, 3]]), cache).dtype == F32 and cache[0].state[0].dtype == F32


def test_load_takes_a_dtype_by_name(tmp_path):
    """``load(path, dtype="bfloat16")`` is ``dtype=mx.bfloat16``; a name that is not a float dtype
    is a one-line MlxformerError before anything is read."""
    from mlxformer.errors import MlxformerError

    directory = write_tiny_byte_llama(tmp_path / "tiny")
    by_name, _ = load(directory, dtype="bfloat16")
    assert by_name.model.norm.weight.dtype == BF16
    with pytest.raises(MlxformerError, match="unsupported dtype 'int8'"):
        load(tmp_path / "missing", dtype="int8")
