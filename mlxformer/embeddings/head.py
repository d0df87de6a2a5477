"""What turns an embedding model's hidden states into one vector: its pooling, the dense
projections after it and the normalization, read from the checkpoint's sentence-transformers
files (``modules.json``, ``1_Pooling/config.json``, ``2_Dense/``, ``config_sentence_transformers.json``)
or, for a GGUF, its ``{arch}.pooling_type``."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import mlx.core as mx

from mlxformer.errors import MlxformerError
from mlxformer.formats.safetensors import load_tensors

__all__ = ["POOLINGS", "Dense", "EmbeddingHead", "read_embedding_head", "with_pooling"]

POOLINGS = ("last", "mean", "cls")
# sentence-transformers' pooling modes -> ours
_ST_POOLING = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
# llama.cpp's ``enum llama_pooling_type``: 0 none, 1 mean, 2 cls, 3 last, 4 rank
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
_ACTIVATIONS = {"Identity": lambda x: x, "Tanh": mx.tanh}


@dataclass(frozen=True)
class Dense:
    """A sentence-transformers ``Dense`` module: ``activation(x @ weight.T + bias)``."""

    weight: mx.array  # (out, in)
    bias: mx.array | None
    activation: str  # a key of ``_ACTIVATIONS``

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ self.weight.T
        return _ACTIVATIONS[self.activation](y if self.bias is None else y + self.bias)


@dataclass(frozen=True)
class EmbeddingHead:
    """How hidden states ``(T, hidden)`` become one embedding: ``pooling`` (``POOLINGS``), then
    each of ``dense``, then an L2 norm when ``normalize``. ``prompts``: named prefixes of the
    input (Qwen3-Embedding's query instruction, EmbeddingGemma's task prompts);
    ``default_prompt``: the one used when the request names none."""

    pooling: str = "last"
    normalize: bool = True
    dense: tuple[Dense, ...] = ()
    prompts: Mapping[str, str] = field(default_factory=dict)
    default_prompt: str | None = None

    def prefix(self, prompt_name: str | None) -> str:
        """The text put before an input given ``prompt_name`` (None: the default prompt's, if any)."""
        name = prompt_name if prompt_name is not None else self.default_prompt
        if name is None:
            return ""
        if name not in self.prompts:
            known = ", ".join(sorted(self.prompts)) or "none"
            raise MlxformerError(f"unknown prompt name {name!r} (this model's: {known})")
        return self.prompts[name]


def with_pooling(head: EmbeddingHead, pooling: str | None) -> EmbeddingHead:
    """``head`` pooling with ``pooling`` instead (None: as it is)."""
    if pooling is None:
        return head
    if pooling not in POOLINGS:
        raise MlxformerError(f"unknown pooling {pooling!r} (choose from {', '.join(POOLINGS)})")
    return dataclasses.replace(head, pooling=pooling)


def read_embedding_head(directory: Path | None, gguf_metadata: Mapping[str, Any] | None = None) -> EmbeddingHead:
    """The head of the model in ``directory`` (its sentence-transformers modules) or of a GGUF
    (``gguf_metadata``); a decoder with neither pools its last token and normalizes."""
    if gguf_metadata is not None:
        arch = gguf_metadata.get("general.architecture")
        kind = gguf_metadata.get(f"{arch}.pooling_type")
        return EmbeddingHead(pooling=_GGUF_POOLING.get(int(kind), "last") if kind is not None else "last")
    modules_file = None if directory is None else directory / "modules.json"
    if modules_file is None or not modules_file.is_file():
        return EmbeddingHead()
    assert directory is not None
    pooling, normalize, dense = "last", False, []
    for module in _read_json(modules_file):
        kind, path = str(module.get("type", "")), directory / str(module.get("path", ""))
        if kind.endswith("Pooling"):
            pooling = _pooling_of(_read_json(path / "config.json"), path)
        elif kind.endswith("Dense"):
            dense.append(_dense_of(path))
        elif kind.endswith("Normalize"):
            normalize = True
    settings = directory / "config_sentence_transformers.json"
    prompts = _read_json(settings) if settings.is_file() else {}
    return EmbeddingHead(pooling, normalize, tuple(dense), dict(prompts.get("prompts") or {}),
                         prompts.get("default_prompt_name"))


def _pooling_of(config: dict[str, Any], path: Path) -> str:
    """sentence-transformers' pooling config (``pooling_mode`` or the older per-mode flags) as ours."""
    mode = config.get("pooling_mode")
    if mode is None:
        mode = next((m for m, flag in (("lasttoken", "pooling_mode_lasttoken"), ("mean", "pooling_mode_mean_tokens"),
                                       ("cls", "pooling_mode_cls_token")) if config.get(flag)), None)
    if mode not in _ST_POOLING:
        raise MlxformerError(f"{path}: unsupported pooling {mode!r} (supported: {', '.join(_ST_POOLING)})")
    return _ST_POOLING[mode]


def _dense_of(path: Path) -> Dense:
    """A ``Dense`` module's weights (``model.safetensors``: ``linear.weight``, ``linear.bias``) and activation."""
    config = _read_json(path / "config.json")
    activation = str(config.get("activation_function", "Identity")).rsplit(".", 1)[-1]
    if activation not in _ACTIVATIONS:
        raise MlxformerError(f"{path}: unsupported activation {activation!r} (supported: {', '.join(_ACTIVATIONS)})")
    weights_file = path / "model.safetensors"
    if not weights_file.is_file():
        raise MlxformerError(f"{path}: no model.safetensors (only safetensors weights are read)")
    weights = load_tensors(weights_file)
    if "linear.weight" not in weights:
        raise MlxformerError(f"{weights_file}: no 'linear.weight'")
    return Dense(weights["linear.weight"].astype(mx.float32),
                 weights["linear.bias"].astype(mx.float32) if "linear.bias" in weights else None, activation)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise MlxformerError(f"cannot read {path}: {exc}") from None
