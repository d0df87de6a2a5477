"""RoPE settings, normalized from a config.json's ``rope_theta``/``rope_scaling`` or
``rope_parameters`` (transformers 5), and written back."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mlxformer.errors import MlxformerError

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "freq_factors", "longrope", "yarn", "proportional")
# Older spellings of rope types.
_ROPE_ALIASES = {"su": "longrope"}


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
    # LongRoPE (Phi-3.5, Phi-4-mini): per-dimension period multipliers used up to / past
    # ``original_max_position_embeddings``, and the factor the rotated features are scaled by.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    # YaRN (gpt-oss, DeepSeek): the rotations bounding the ramp between extrapolated and
    # interpolated frequencies, whether its ends are rounded outward, and the mscale pair
    # DeepSeek derives ``attention_factor`` from.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    # "proportional" (Gemma 4's full layers): the first ``rotated_fraction * dims / 2`` frequencies
    # of the whole head's, the rest zero (those feature pairs are not rotated).
    rotated_fraction: float = 1.0


def rope_config_from_dict(config: dict[str, Any], layer_type: str = "full_attention") -> RopeConfig:
    """Normalize ``rope_theta``/``rope_scaling`` (classic) or ``rope_parameters`` (transformers 5;
    Gemma 3's is keyed by layer type, ``layer_type`` picks one)."""
    params = dict(config.get("rope_parameters") or {})
    if isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    scaling = dict(config.get("rope_scaling") or {})
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    merged = {**params, **scaling}
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    rope_type = _ROPE_ALIASES.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise MlxformerError(f"unsupported rope type {rope_type!r} (supported: default, linear, dynamic, llama3, longrope, "
                             "yarn, proportional)")
    factor = float(merged.get("factor", 1.0))
    if rope_type in ("linear", "dynamic", "llama3", "yarn") and "factor" not in merged:
        raise MlxformerError(f"rope type {rope_type!r} needs a 'factor'")
    original = int(
        merged.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
        or config.get("max_position_embeddings") or 8192
    )
    short = tuple(float(f) for f in merged.get("short_factor") or ())
    long = tuple(float(f) for f in merged.get("long_factor") or ())
    attention_factor = 1.0
    if rope_type == "longrope":
        if not short or len(short) != len(long):
            raise MlxformerError("rope type 'longrope' needs short_factor and long_factor lists of one length")
        # transformers: the context ratio, and sqrt(1 + log(ratio) / log(original)) when it grows
        ratio = float(merged.get("factor") or int(config.get("max_position_embeddings") or original) / original)
        attention_factor = float(merged.get("attention_factor") or (
            math.sqrt(1 + math.log(ratio) / math.log(original)) if ratio > 1 else 1.0))
    if rope_type == "yarn":
        attention_factor = yarn_attention_factor(merged, factor)
    return RopeConfig(
        theta=float(theta),
        type=rope_type,
        factor=factor,
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        freq_factors=tuple(float(f) for f in merged.get("freq_factors", ())),
        short_factor=short,
        long_factor=long,
        attention_factor=attention_factor,
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        truncate=bool(merged.get("truncate", True)),
        mscale=float(merged.get("mscale") or 0.0),
        mscale_all_dim=float(merged.get("mscale_all_dim") or 0.0),
        rotated_fraction=float(merged.get("partial_rotary_factor", 1.0)) if rope_type == "proportional" else 1.0,
    )


def yarn_attention_factor(scaling: dict[str, Any], factor: float) -> float:
    """YaRN's attention factor as transformers derives it: given, or ``0.1 ln(factor) + 1``
    (DeepSeek: the ratio of that for ``mscale`` and ``mscale_all_dim``)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude scale ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


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
    if rope.type == "yarn":
        scaling.update(beta_fast=rope.beta_fast, beta_slow=rope.beta_slow, truncate=rope.truncate,
                       attention_factor=rope.attention_factor,
                       original_max_position_embeddings=rope.original_max_position_embeddings)
        if rope.mscale:
            scaling.update(mscale=rope.mscale, mscale_all_dim=rope.mscale_all_dim)
    if rope.type == "proportional":
        scaling["partial_rotary_factor"] = rope.rotated_fraction
    if rope.type == "longrope":
        del scaling["factor"]
        scaling.update(short_factor=list(rope.short_factor), long_factor=list(rope.long_factor),
                       original_max_position_embeddings=rope.original_max_position_embeddings)
    return scaling
