"""``load``: a local HF/MLX dir, a Hugging Face repo id or a GGUF file -> (model, tokenizer).

Every load checks the key set and each tensor's shape against the decoder, and errors
name the offending key. Only safetensors and GGUF are read: never pickles, never code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxformer.embeddings.head import read_embedding_head
from mlxformer.errors import MlxformerError
from mlxformer.formats.checkpoint import Checkpoint, open_checkpoint
from mlxformer.formats.tensors import Tensors
from mlxformer.models.config import ModelArgs, float_dtype
from mlxformer.models.decoder import Model
from mlxformer.formats.gpt_oss import MXFP4, derive_dict, fused_expert_derivations
from mlxformer.models.families import text_weight_names
from mlxformer.models.gemma4 import expert_derivations as gemma4_expert_derivations
from mlxformer.models.gpt2_family import conv1d_derivations
from mlxformer.models.mla import absorbed_kv_b
from mlxformer.models.moe import expert_groups, stack_expert_arrays
from mlxformer.models.dtype_policy import apply_dtype_policy, cast_except_quantized_linears, is_quantized
from mlxformer.models.device_plan import DevicePlan, wire_memory
from mlxformer.models.row_sharding import apply_thread_policy
from mlxformer.text.tokenizer import Tokenizer, load_tokenizer_from_dir, load_tokenizer_from_gguf

__all__ = ["apply_dtype_policy", "build_model", "cast_except_quantized_linears", "is_quantized", "load",
           "read_checkpoint", "load_tokenizer", "used_tensors"]

# What ``check_weights`` needs of a tensor: an ``mx.array`` or a header ``TensorEntry``.
Shaped = Any


def quantization_of(config: dict[str, Any]) -> dict[str, Any] | None:
    """The mlx-lm ``quantization`` entry of a config (``quantization_config`` as fallback)."""
    quantization = config.get("quantization") or config.get("quantization_config")
    if quantization and quantization.get("quant_method") == "mxfp4":  # HF's gpt-oss: the experts' blocks
        return dict(MXFP4)
    if quantization and quantization.get("mode", "affine") not in QUANT_MODES:
        raise MlxformerError(f"unsupported quantization mode {quantization['mode']!r} (supported: {', '.join(QUANT_MODES)})")
    return quantization or None


# MLX's quantization modes: affine (scales and biases) and the float-scaled microscaling formats.
QUANT_MODES = ("affine", "mxfp4", "mxfp8", "nvfp4")


def quantize_like_checkpoint(model: nn.Module, quantization: dict[str, Any], weights: Mapping[str, Shaped]) -> None:
    """Swap in quantized layers wherever the checkpoint has ``<layer>.scales``, with per-layer overrides."""

    def predicate(path: str, module: nn.Module) -> bool | dict[str, int]:
        if f"{path}.scales" not in weights:
            return False
        override = quantization.get(path)
        if isinstance(override, dict):
            return {"group_size": int(override["group_size"]), "bits": int(override["bits"]),
                    "mode": str(override.get("mode", mode))}
        return override is not False

    mode = str(quantization.get("mode", "affine"))
    nn.quantize(
        model,
        group_size=int(quantization.get("group_size", 64)),
        bits=int(quantization.get("bits", 4)),
        mode=mode,
        class_predicate=predicate,
    )


def check_weights(model: nn.Module, weights: Mapping[str, Shaped]) -> None:
    """Raise naming the first missing, unexpected, mis-shaped or mis-typed key (a float
    parameter needs a float tensor, a packed one the same integer dtype). ``weights`` may be
    arrays or header entries: nothing is read."""
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise MlxformerError(f"checkpoint is missing weight {missing[0]!r}" + _more(missing))
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise MlxformerError(f"checkpoint has unexpected weight {unexpected[0]!r}" + _more(unexpected))
    for name, param in expected.items():
        given = weights[name]
        if tuple(given.shape) != tuple(param.shape):
            raise MlxformerError(
                f"weight {name!r} has shape {tuple(given.shape)}, the config implies {tuple(param.shape)}"
            )
        floating = mx.issubdtype(param.dtype, mx.floating)
        if floating != mx.issubdtype(given.dtype, mx.floating) or (not floating and given.dtype != param.dtype):
            kind = "a floating dtype" if floating else str(param.dtype).removeprefix("mlx.core.")
            raise MlxformerError(f"weight {name!r} has dtype {str(given.dtype).removeprefix('mlx.core.')}, "
                                 f"the model needs {kind}")


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def used_tensors(args: ModelArgs, tensors: Tensors) -> Tensors:
    """The tensors the decoder uses (``Model.sanitize``: no rotary tables, no tied output
    projection), still lazy. Sanitizing must only drop keys here: it sees header entries."""
    tensors = tensors.derived(conv1d_derivations(tensors.entries))  # GPT-2's Conv1D weights, transposed and renamed
    tensors = tensors.renamed(text_weight_names(tensors.entries))  # an image-text checkpoint's language model, GPT-2's
    if args.num_experts:  # HF's per-expert matrices -> stacked (experts, out, in), still lazy
        tensors = tensors.stacked(expert_groups(tensors.entries, args.num_experts))
        tensors = tensors.derived(fused_expert_derivations(tensors.entries))  # gpt-oss
        tensors = tensors.derived(gemma4_expert_derivations(tensors.entries))  # Gemma 4
    if args.attention_type == "mla":  # mlx-lm's split kv_b_proj -> HF's, still lazy
        tensors = tensors.derived(absorbed_kv_b(tensors.entries, args))
    kept = Model(args, num_layers=0, with_ends=False).sanitize(dict(tensors.entries))
    if any(kept[name] is not tensors.entries.get(name) for name in kept):
        raise MlxformerError("Model.sanitize changed a tensor; streamed reading needs it to only drop keys")
    return tensors.subset(kept)


def checked_model(
    config: dict[str, Any], weights: Mapping[str, mx.array], num_layers: int | None = None, with_ends: bool = True,
    first_layer: int = 0,
) -> tuple[Model, Mapping[str, mx.array]]:
    """The decoder for ``config``, its parameters lazy and not loaded, quantized where the
    checkpoint is, and the weights it uses, checked by name, shape and dtype. ``weights`` may
    be a checkpoint's lazy ``Tensors``: then only their header entries are looked at, and the
    tensors returned are still lazy."""
    model = Model(ModelArgs.from_dict(config), num_layers, with_ends, first_layer)
    if isinstance(weights, Tensors):
        weights = used_tensors(model.args, weights)
        described: Mapping[str, Shaped] = weights.entries
    else:
        weights = derive_dict(dict(weights), conv1d_derivations(weights))
        renames = text_weight_names(weights)
        weights = {renames.get(name, name): array for name, array in weights.items()}
        if model.args.num_experts:
            weights = stack_expert_arrays(weights, model.args.num_experts)
            weights = derive_dict(weights, fused_expert_derivations(weights))
            weights = derive_dict(weights, gemma4_expert_derivations(weights))
        weights = described = model.sanitize(weights)
    quantization = quantization_of(config)
    if quantization:  # per-layer entries under the decoder's names (an image-text checkpoint's renamed)
        renames = text_weight_names(quantization)
        quantization = {renames.get(key, key): value for key, value in quantization.items()}
        quantize_like_checkpoint(model, quantization, described)
    check_weights(model, described)
    return model, weights


def build_model(
    config: dict[str, Any], weights: Mapping[str, mx.array], num_layers: int | None = None, with_ends: bool = True,
    first_layer: int = 0,
) -> Model:
    """Instantiate the decoder for ``config`` and load checked ``weights`` into it
    (``num_layers``/``with_ends``/``first_layer``: one pipeline stage, see ``Model``)."""
    model, weights = checked_model(config, weights, num_layers, with_ends, first_layer)
    model.load_weights([(name, weights[name]) for name in weights], strict=True)
    model.eval()
    return model


def read_checkpoint(path: str | Path) -> tuple[dict[str, Any], Tensors, dict[str, Any] | None]:
    """``(config, lazy tensors, GGUF metadata or None)`` of a dir, repo id or GGUF file, for
    ``build_model``."""
    checkpoint = open_checkpoint(path)
    return checkpoint.config, checkpoint.tensors, checkpoint.gguf_metadata


def load_tokenizer(checkpoint: Checkpoint) -> Tokenizer:
    """The checkpoint's tokenizer: its dir's files, or the GGUF's vocabulary."""
    if checkpoint.gguf_metadata is not None:
        return load_tokenizer_from_gguf(checkpoint.gguf_metadata, checkpoint.path)
    assert checkpoint.tokenizer_dir is not None
    return load_tokenizer_from_dir(checkpoint.tokenizer_dir)


def load(
    path_or_repo: str | Path, dtype: mx.Dtype | str | None = None, threads: int | None = None,
    plan: DevicePlan | None = None,
) -> tuple[Model, Tokenizer]:
    """Load a model and its tokenizer from a local HF/MLX dir, a hub repo id or a ``.gguf`` file.

    Args:
        path_or_repo: where the model is.
        dtype: compute dtype for floating parameters (an ``mx.Dtype`` or its name, e.g.
            ``"bfloat16"``); ``None`` applies the backend policy
            (see ``models.dtype_policy.decide_dtype``).
        threads: CPU streams each projection is split over; ``None`` applies the backend
            policy (see ``models.row_sharding.apply_thread_policy``), 1 turns it off.
        plan: the device plan whose policies apply (default: the default device's); the GPU
            plan may be forced on the CPU (``DevicePlan("gpu")``: its dtype, no CPU streams).
    """
    dtype = float_dtype(dtype)
    checkpoint = open_checkpoint(path_or_repo)
    model = build_model(checkpoint.config, checkpoint.tensors)
    model.embedding_head = read_embedding_head(None if checkpoint.is_gguf else checkpoint.path, checkpoint.gguf_metadata)
    tokenizer = load_tokenizer(checkpoint)
    plan = plan or DevicePlan.current()
    apply_dtype_policy(model, dtype, plan.device)
    apply_thread_policy(model, plan.threads if threads is None else threads)
    if plan.kind == "gpu":
        wire_memory()
    return model, tokenizer
