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
from mlxformer.formats.weight_map import decoder_quantization, decoder_weights
from mlxformer.models.dtype_policy import apply_dtype_policy, cast_except_quantized_linears, is_quantized
from mlxformer.models.device_plan import DevicePlan, wire_memory
from mlxformer.models.row_sharding import apply_thread_policy
from mlxformer.sampling.options import check_integer, checked
from mlxformer.text.tokenizer import Tokenizer, load_tokenizer_from_dir, load_tokenizer_from_gguf

__all__ = ["apply_dtype_policy", "build_model", "cast_except_quantized_linears", "checked_model", "is_quantized", "load",
           "loaded_model", "read_checkpoint", "load_tokenizer"]

# What ``check_weights`` needs of a tensor: an ``mx.array`` or a header ``TensorEntry``.
Shaped = Any


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


def checked_model(
    args: ModelArgs, weights: Mapping[str, mx.array], quantization: dict[str, Any] | None = None,
    num_layers: int | None = None, with_ends: bool = True, first_layer: int = 0,
) -> Model:
    """The decoder of ``args``, its parameters lazy and not loaded, quantized as ``quantization``
    says where ``weights`` (under the decoder's names: ``weight_map.decoder_weights``) have
    scales, after checking ``weights`` by name, shape and dtype. Lazy ``Tensors`` are only
    looked at through their header entries."""
    model = Model(args, num_layers, with_ends, first_layer)
    described: Mapping[str, Shaped] = weights.entries if isinstance(weights, Tensors) else weights
    if quantization:
        quantize_like_checkpoint(model, quantization, described)
    check_weights(model, described)
    return model


def loaded_model(
    args: ModelArgs, weights: Mapping[str, mx.array], quantization: dict[str, Any] | None = None,
    num_layers: int | None = None, with_ends: bool = True, first_layer: int = 0,
) -> Model:
    """``checked_model`` with ``weights`` loaded into it (``num_layers``/``with_ends``/
    ``first_layer``: one pipeline stage, see ``Model``)."""
    model = checked_model(args, weights, quantization, num_layers, with_ends, first_layer)
    model.load_weights([(name, weights[name]) for name in weights], strict=True)
    model.eval()
    return model


def build_model(config: dict[str, Any], weights: Mapping[str, mx.array]) -> Model:
    """The decoder of a ``config.json`` dict with ``weights`` (lazy ``Tensors`` or a dict of
    arrays, under the checkpoint's names) loaded, through the one rename path."""
    args = ModelArgs.from_dict(config)
    return loaded_model(args, decoder_weights(args, weights), decoder_quantization(config))


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
    checked("path_or_repo", path_or_repo, (str, Path))
    threads = None if threads is None else check_integer("threads", threads, low=1)
    dtype = float_dtype(dtype)
    checkpoint = open_checkpoint(path_or_repo)
    model = loaded_model(checkpoint.args, checkpoint.weights, checkpoint.quantization)
    model.embedding_head = read_embedding_head(None if checkpoint.is_gguf else checkpoint.path, checkpoint.gguf_metadata)
    tokenizer = load_tokenizer(checkpoint)
    plan = plan or DevicePlan.current()
    apply_dtype_policy(model, dtype, plan.device)
    apply_thread_policy(model, plan.threads if threads is None else threads)
    if plan.kind == "gpu":
        wire_memory()
    return model, tokenizer
