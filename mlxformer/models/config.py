"""The frozen model configuration that drives the one decoder.

Every supported family (Llama 1-3.2, Mistral, Qwen2/2.5, Qwen3, SmolLM, TinyLlama) is a
set of field values here, read from an HF ``config.json`` dict or from GGUF metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxformer.errors import MlxformerError

# Floating dtypes users may name on the command line or in the API.
FLOAT_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "freq_factors")

# Keys of a config.json that change the math but that this decoder does not implement.
_UNSUPPORTED_TRUE_FLAGS = ("use_sliding_window",)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings, normalized from ``rope_theta``/``rope_scaling``/``rope_parameters``."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # Per-dimension period multipliers (llama.cpp's ``rope_freqs`` tensor), only for type "freq_factors".
    freq_factors: tuple[float, ...] = ()


@dataclass(frozen=True)
class ModelArgs:
    """Shape and behaviour of a LLaMA-style decoder."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "ModelArgs":
        """Build the args from an HF/mlx-lm ``config.json`` dict; unsupported settings raise."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise MlxformerError(
                f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        for flag in _UNSUPPORTED_TRUE_FLAGS:
            if config.get(flag):
                raise MlxformerError(f"unsupported config setting {flag}=true for {model_type}")
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            head_dim = config.get("head_dim") or hidden // heads
            attention_bias = bool(config.get("attention_bias", False))
            is_qwen2 = model_type == "qwen2"
            return cls(
                model_type=model_type,
                hidden_size=hidden,
                num_hidden_layers=int(config["num_hidden_layers"]),
                intermediate_size=int(config["intermediate_size"]),
                num_attention_heads=heads,
                num_key_value_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                vocab_size=int(config["vocab_size"]),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope=rope_config_from_dict(config),
                max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases and never an o_proj bias; Llama-style
                # ``attention_bias`` covers all four projections.
                qkv_bias=True if is_qwen2 else attention_bias,
                o_proj_bias=False if is_qwen2 else attention_bias,
                mlp_bias=bool(config.get("mlp_bias", False)),
                qk_norm=model_type == "qwen3",
                sliding_window=_sliding_window(config),
            )
        except KeyError as exc:
            raise MlxformerError(f"config.json is missing required key {exc.args[0]!r}") from None

    def to_dict(self) -> dict[str, Any]:
        """An HF-style ``config.json`` dict that ``from_dict`` reads back to equal args."""
        config: dict[str, Any] = {
            "model_type": self.model_type,
            "architectures": [_ARCHITECTURES[self.model_type]],
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": self.rope.theta,
            "rope_scaling": rope_scaling_dict(self.rope),
            "hidden_act": "silu",
        }
        if self.model_type != "qwen2":
            config["attention_bias"] = self.o_proj_bias
        if self.mlp_bias:
            config["mlp_bias"] = True
        if self.sliding_window is not None:
            config["sliding_window"] = self.sliding_window
        return config


_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def _sliding_window(config: dict[str, Any]) -> int | None:
    # Qwen2 configs carry a sliding_window value that is inactive unless use_sliding_window is set.
    if config.get("model_type") != "mistral":
        return None
    window = config.get("sliding_window")
    return int(window) if window else None


def rope_config_from_dict(config: dict[str, Any]) -> RopeConfig:
    """Normalize ``rope_theta``/``rope_scaling`` (classic) or ``rope_parameters`` (transformers 5)."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    merged = {**params, **scaling}
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise MlxformerError(f"unsupported rope type {rope_type!r} (supported: default, linear, dynamic, llama3)")
    factor = float(merged.get("factor", 1.0))
    if rope_type in ("linear", "dynamic", "llama3") and "factor" not in merged:
        raise MlxformerError(f"rope type {rope_type!r} needs a 'factor'")
    return RopeConfig(
        theta=float(theta),
        type=rope_type,
        factor=factor,
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            merged.get("original_max_position_embeddings") or config.get("max_position_embeddings") or 8192
        ),
        freq_factors=tuple(float(f) for f in merged.get("freq_factors", ())),
    )


def rope_scaling_dict(rope: RopeConfig) -> dict[str, Any] | None:
    """The ``rope_scaling`` entry of a config.json for these settings (None for plain RoPE)."""
    if rope.type == "default":
        return None
    scaling: dict[str, Any] = {"rope_type": rope.type, "type": rope.type, "factor": rope.factor}
    if rope.type == "llama3":
        scaling.update(
            low_freq_factor=rope.low_freq_factor,
            high_freq_factor=rope.high_freq_factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
        )
    if rope.type == "freq_factors":
        scaling["freq_factors"] = list(rope.freq_factors)
    return scaling
