"""The compute dtype policy: which dtype activations and the KV cache use, on every backend.

``decide_dtype`` is a pure function of (device kind, the checkpoint's floating dtypes,
quantized?, requested dtype); ``apply_dtype_policy`` reads those from a loaded model and
casts its parameters so that every activation, and so the KV cache, is in that dtype
(a float32 norm weight would otherwise promote a 16-bit model's activations to float32).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping

import mlx.core as mx
import mlx.nn as nn

# A GPU checkpoint without any 16-bit array (all float32) computes in bfloat16: it keeps
# float32's exponent range, so activations that fit in float32 cannot overflow (float16
# stops at 65504, which the residual stream of some LLMs exceeds).
GPU_DEFAULT_16BIT = mx.bfloat16
SIXTEEN_BIT = (mx.float16, mx.bfloat16)
# Families whose activations pass float16's 65,504 (Gemma scales the embedding by sqrt(hidden);
# the Gemma 3 270M GGUF's residual reaches ~103,800: NaN logits in float16). They never compute
# in float16 by default; other models are probed at load (``overflows``).
FLOAT16_OVERFLOW_FAMILIES = frozenset({"gemma", "gemma2", "gemma3_text", "gemma4_text"})
PROBE_TOKENS = 16


def float16_safe(model_type: str) -> bool:
    """Whether a family's activations stay within float16's range."""
    return model_type not in FLOAT16_OVERFLOW_FAMILIES


@dataclass(frozen=True)
class DtypePlan:
    """Cast every floating parameter to ``compute`` (activations and KV cache follow), except
    the scales/biases of quantized linear layers when ``keep_quantized_linear_scales``."""

    compute: mx.Dtype
    keep_quantized_linear_scales: bool = False


def decide_dtype(
    device: mx.DeviceType, checkpoint_dtypes: Mapping[mx.Dtype, int], quantized: bool, requested: mx.Dtype | None,
    float16_ok: bool = True,
) -> DtypePlan:
    """The compute dtype for a model.

    Args:
        device: where it runs (``mx.DeviceType.cpu`` or ``mx.DeviceType.gpu``).
        checkpoint_dtypes: element count of each floating dtype among its parameters
            (packed quantized weights are integers and do not count; their scales do).
        quantized: whether any layer holds packed quantized weights.
        requested: an explicit dtype (``load(dtype=...)``, ``--dtype``): always wins.
        float16_ok: whether the model's activations fit float16 (``float16_safe``).

    Rules: a requested dtype casts everything. On a GPU, 16-bit: the checkpoint's most common
    16-bit dtype (a GGUF's float16 scales, a bf16 safetensors' bfloat16), else bfloat16, and
    bfloat16 instead of float16 unless ``float16_ok``; F32 norms and embeddings are cast to it. On the CPU, quantized models compute in float32
    (``quantized_matmul`` is 9-40x slower and less accurate with 16-bit activations there;
    16-bit scales of quantized linear layers stay as stored: the kernel widens them exactly);
    a float checkpoint keeps its dtype if it has one, and a mixed one (F16 weights, F32 norms)
    computes in float32, the dtype MLX's promotion would give, without per-call conversions.
    """
    if requested is not None:
        return DtypePlan(requested)
    if device == mx.DeviceType.gpu:
        sixteen = {dtype: n for dtype, n in checkpoint_dtypes.items() if dtype in SIXTEEN_BIT}
        chosen = max(sixteen, key=sixteen.__getitem__) if sixteen else GPU_DEFAULT_16BIT
        return DtypePlan(chosen if chosen != mx.float16 or float16_ok else GPU_DEFAULT_16BIT)
    if quantized:
        return DtypePlan(mx.float32, keep_quantized_linear_scales=True)
    if len(checkpoint_dtypes) == 1:
        return DtypePlan(next(iter(checkpoint_dtypes)))
    return DtypePlan(mx.float32)


def floating_dtypes(model: nn.Module) -> Counter[mx.Dtype]:
    """Element count of each floating dtype among ``model``'s parameters."""
    counts: Counter[mx.Dtype] = Counter()
    for _, module in model.named_modules():
        for value in module.values():
            if isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating):
                counts[value.dtype] += value.size
    return counts


def is_quantized(model: nn.Module) -> bool:
    """Whether any layer holds packed quantized weights."""
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def cast_floating(model: nn.Module, dtype: mx.Dtype, keep_quantized_linear_scales: bool = False) -> None:
    """Cast every floating parameter to ``dtype``, optionally except the scales/biases of
    quantized linear layers. (A quantized embedding is always cast: its lookup dequantizes in
    its scales' dtype, while ``quantized_matmul`` widens 16-bit scales exactly.)"""
    for _, module in model.named_modules():
        if keep_quantized_linear_scales and isinstance(module, nn.QuantizedLinear):
            continue
        local = {
            name: value.astype(dtype)
            for name, value in module.items()
            if isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating) and value.dtype != dtype
        }
        if local:
            module.update(local)


def cast_except_quantized_linears(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast every floating parameter to ``dtype`` except the scales/biases of quantized linear layers."""
    cast_floating(model, dtype, keep_quantized_linear_scales=True)


def overflows(model: nn.Module) -> bool:
    """Whether a short probe (``PROBE_TOKENS`` ids spread over the vocabulary) gives non-finite logits."""
    vocab = model.args.vocab_size
    ids = mx.arange(PROBE_TOKENS) * (vocab // PROBE_TOKENS)  # (T,)
    return not bool(mx.isfinite(model(ids[None])).all().item())


def apply_dtype_policy(model: nn.Module, requested: mx.Dtype | None, device: mx.DeviceType | None = None) -> DtypePlan:
    """Decide the compute dtype for ``model`` on ``device`` (default: the default device's kind)
    and cast its parameters; a default float16 whose probe overflows becomes bfloat16."""
    device = device if device is not None else mx.default_device().type
    plan = decide_dtype(device, floating_dtypes(model), is_quantized(model), requested,
                        float16_safe(model.args.model_type))
    stored = model.parameters()
    cast_floating(model, plan.compute, plan.keep_quantized_linear_scales)
    if requested is None and plan.compute == mx.float16 and overflows(model):
        model.update(stored)  # cast once, from the checkpoint's dtypes
        plan = DtypePlan(GPU_DEFAULT_16BIT, plan.keep_quantized_linear_scales)
        cast_floating(model, plan.compute, plan.keep_quantized_linear_scales)
    return plan
