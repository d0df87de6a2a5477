"""``load``: a local HF/MLX dir, a Hugging Face repo id or a GGUF file -> (model, tokenizer).

Every load checks the key set and each tensor's shape against the decoder, and errors
name the offending key. Only safetensors and GGUF are read: never pickles, never code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxformer.models.config import ModelArgs
from mlxformer.errors import MlxformerError
from mlxformer.formats.gguf import load_gguf
from mlxformer.models.decoder import Model
from mlxformer.models.dtype_policy import apply_dtype_policy, cast_except_quantized_linears, is_quantized
from mlxformer.models.row_sharding import apply_thread_policy
from mlxformer.formats.hub import resolve_source
from mlxformer.formats.safetensors import load_safetensors, read_config, safetensors_files
from mlxformer.tokenizer import Tokenizer, load_tokenizer_from_dir, load_tokenizer_from_gguf

__all__ = ["apply_dtype_policy", "build_model", "cast_except_quantized_linears", "is_quantized", "load", "read_checkpoint"]


def quantization_of(config: dict[str, Any]) -> dict[str, Any] | None:
    """The mlx-lm ``quantization`` entry of a config (``quantization_config`` as fallback)."""
    quantization = config.get("quantization") or config.get("quantization_config")
    if quantization and quantization.get("mode", "affine") != "affine":
        raise MlxformerError(f"unsupported quantization mode {quantization['mode']!r} (only affine)")
    return quantization or None


def quantize_like_checkpoint(model: nn.Module, quantization: dict[str, Any], weights: dict[str, mx.array]) -> None:
    """Swap in quantized layers wherever the checkpoint has ``<layer>.scales``, with per-layer overrides."""

    def predicate(path: str, module: nn.Module) -> bool | dict[str, int]:
        if f"{path}.scales" not in weights:
            return False
        override = quantization.get(path)
        if isinstance(override, dict):
            return {"group_size": int(override["group_size"]), "bits": int(override["bits"])}
        return override is not False

    nn.quantize(
        model,
        group_size=int(quantization.get("group_size", 64)),
        bits=int(quantization.get("bits", 4)),
        class_predicate=predicate,
    )


def check_weights(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """Raise naming the first missing, unexpected or mis-shaped key."""
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise MlxformerError(f"checkpoint is missing weight {missing[0]!r}" + _more(missing))
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise MlxformerError(f"checkpoint has unexpected weight {unexpected[0]!r}" + _more(unexpected))
    for name, param in expected.items():
        if tuple(weights[name].shape) != tuple(param.shape):
            raise MlxformerError(
                f"weight {name!r} has shape {tuple(weights[name].shape)}, the config implies {tuple(param.shape)}"
            )


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def build_model(
    config: dict[str, Any], weights: dict[str, mx.array], num_layers: int | None = None, with_ends: bool = True,
    first_layer: int = 0,
) -> Model:
    """Instantiate the decoder for ``config`` and load checked ``weights`` into it
    (``num_layers``/``with_ends``/``first_layer``: one pipeline stage, see ``Model``)."""
    model = Model(ModelArgs.from_dict(config), num_layers, with_ends, first_layer)
    weights = model.sanitize(weights)
    quantization = quantization_of(config)
    if quantization:
        quantize_like_checkpoint(model, quantization, weights)
    check_weights(model, weights)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    return model


def read_checkpoint(source: Path) -> tuple[dict[str, Any], dict[str, mx.array], dict[str, Any] | None]:
    """``(config, weights, gguf metadata or None)`` from a resolved local dir or GGUF file."""
    if source.is_file():
        if source.suffix.lower() != ".gguf":
            raise MlxformerError(f"{source}: not a model dir or .gguf file")
        return load_gguf(source)
    config = read_config(source)
    ModelArgs.from_dict(config)  # fail on an unsupported model before touching the weights
    return config, load_safetensors(safetensors_files(source)), None


def load(
    path_or_repo: str | Path, dtype: mx.Dtype | None = None, threads: int | None = None
) -> tuple[Model, Tokenizer]:
    """Load a model and its tokenizer from a local HF/MLX dir, a hub repo id or a ``.gguf`` file.

    Args:
        path_or_repo: where the model is.
        dtype: compute dtype for floating parameters; ``None`` applies the backend policy
            (see ``models.dtype_policy.decide_dtype``).
        threads: CPU streams each projection is split over; ``None`` applies the backend
            policy (see ``models.row_sharding.apply_thread_policy``), 1 turns it off.
    """
    source = resolve_source(path_or_repo)
    config, weights, metadata = read_checkpoint(source)
    model = build_model(config, weights)
    tokenizer = load_tokenizer_from_gguf(metadata) if metadata is not None else load_tokenizer_from_dir(source)
    apply_dtype_policy(model, dtype)
    apply_thread_policy(model, threads)
    return model, tokenizer
