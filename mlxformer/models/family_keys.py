"""Readers of config.json keys that several families share (``families``, ``gemma4_family``)."""

from __future__ import annotations

from typing import Any, Callable

from mlxformer.errors import MlxformerError

Fields = dict[str, Any]
# transformers' activation names -> the decoder's gate functions (``models.mlp.GATES``)
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def activation(config: dict[str, Any], default: str, *keys: str) -> str:
    """The decoder's gate for the first of ``keys`` the config sets (``default`` if none)."""
    name = next((config[k] for k in keys if config.get(k)), default)
    if name not in _ACTIVATIONS:
        raise MlxformerError(f"unsupported activation {name!r} for {config.get('model_type')}")
    return _ACTIVATIONS[name]


def layer_types(config: dict[str, Any], sliding: Callable[[int], bool]) -> tuple[str, ...]:
    """Per layer "sliding" or "full": the config's ``layer_types`` or the family's pattern."""
    layers = int(config["num_hidden_layers"])
    written = config.get("layer_types")
    if written is None:
        return tuple("sliding" if sliding(i) else "full" for i in range(layers))
    names = {"sliding_attention": "sliding", "full_attention": "full"}
    if len(written) != layers or any(t not in names for t in written):
        raise MlxformerError(f"config.json layer_types must name {layers} layers as sliding_attention/full_attention")
    return tuple(names[t] for t in written)


def window(config: dict[str, Any]) -> int | None:
    """The config's ``sliding_window`` (None when absent or 0)."""
    size = config.get("sliding_window")
    return int(size) if size else None


def float_or_none(value: Any) -> float | None:
    """``value`` as a float; None stays None."""
    return None if value is None else float(value)
