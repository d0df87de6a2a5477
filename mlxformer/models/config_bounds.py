"""Bounds on every size a config gives, checked before anything is built from it.

A config is input: a corrupt or hostile ``num_local_experts: 30000000`` or ``num_hidden_layers``
of a billion must fail in microseconds with a line naming the key, not after seconds of
building per-layer tuples or per-expert name tables. Each bound is far above any released
model (largest seen: ~130 layers, 262k vocabulary, 512 experts, 512-wide heads, 1536 ranks).
"""

from __future__ import annotations

import math
from typing import Any

from mlxformer.errors import MlxformerError

# config.json key -> the largest value accepted (0 is accepted where a key means "none").
SIZE_BOUNDS: dict[str, int] = {
    "num_hidden_layers": 4096,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "num_attention_heads": 4096,
    "num_key_value_heads": 4096,
    "head_dim": 1 << 14,
    "global_head_dim": 1 << 14,
    "vocab_size": 1 << 23,
    "max_position_embeddings": (1 << 31) - 1,
    "sliding_window": (1 << 31) - 1,
    # mixture of experts
    "num_experts": 1 << 14,
    "num_local_experts": 1 << 14,
    "n_routed_experts": 1 << 14,
    "n_shared_experts": 1 << 10,
    "num_experts_per_tok": 1 << 14,
    "moe_intermediate_size": 1 << 20,
    "shared_expert_intermediate_size": 1 << 20,
    "decoder_sparse_step": 4096,
    "first_k_dense_replace": 4096,
    "n_group": 1 << 14,
    "topk_group": 1 << 14,
    # low-rank (MLA) projections and split head sizes
    "q_lora_rank": 1 << 17,
    "kv_lora_rank": 1 << 17,
    "qk_rope_head_dim": 1 << 14,
    "qk_nope_head_dim": 1 << 14,
    "v_head_dim": 1 << 14,
    # per-layer inputs and shared KV (Gemma 4)
    "hidden_size_per_layer_input": 1 << 17,
    "vocab_size_per_layer_input": 1 << 23,
    "num_kv_shared_layers": 4096,
    "num_global_key_value_heads": 4096,
    "top_k_experts": 1 << 14,
    "no_rope_layer_interval": 4096,
    "sliding_window_pattern": 4096,
}
# config.json keys (and rope_scaling / rope_parameters keys) that must be positive, finite numbers.
POSITIVE_KEYS = ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "rope_theta")
ROPE_POSITIVE_KEYS = ("rope_theta", "factor")
# config.json keys holding one entry per layer.
PER_LAYER_KEYS = ("layer_types", "no_rope_layers")
# Lists of per-frequency factors: at most one per rotary pair of the widest head.
FACTOR_KEYS = ("short_factor", "long_factor", "freq_factors")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_config_sizes(config: dict[str, Any]) -> None:
    """Raise ``MlxformerError`` naming the first size key of ``config`` that is not an integer
    within its bound, a per-layer list whose length is not the layer count, or a list of
    layer indices outside the layers; nothing is allocated before these checks."""
    for key, bound in SIZE_BOUNDS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # GGUF metadata and some writers store sizes as floats
        if not _is_int(value) or not 0 <= value <= bound:
            raise MlxformerError(f"config.json {key} must be an integer in 0..{bound}, not {str(value)[:40]}")
    layers = config.get("num_hidden_layers")
    for key in PER_LAYER_KEYS:
        listed = config.get(key)
        if listed is not None and (not isinstance(listed, list) or len(listed) != layers):
            length = len(listed) if isinstance(listed, list) else type(listed).__name__
            raise MlxformerError(f"config.json {key} must list the {layers} layers, not {length}")
    dense = config.get("mlp_only_layers")
    if dense is not None and (not isinstance(dense, list) or len(dense) > SIZE_BOUNDS["num_hidden_layers"]
                              or not all(_is_int(i) for i in dense)):
        raise MlxformerError("config.json mlp_only_layers must be a list of layer indices")
    for key in POSITIVE_KEYS:
        _check_positive(key, config.get(key))
    for scaling in (config.get("rope_scaling"), config.get("rope_parameters")):
        for params in _rope_dicts(scaling):
            for key in ROPE_POSITIVE_KEYS:
                _check_positive(f"rope {key}", params.get(key))
            for key in FACTOR_KEYS:
                factors = params.get(key)
                if factors is not None and (not isinstance(factors, list) or len(factors) > SIZE_BOUNDS["head_dim"]):
                    raise MlxformerError(f"config.json rope {key} must be a list of at most "
                                         f"{SIZE_BOUNDS['head_dim']} factors")


def _rope_dicts(scaling: Any) -> list[dict[str, Any]]:
    """A ``rope_scaling``/``rope_parameters`` entry as its dicts (keyed by layer type or not)."""
    if not isinstance(scaling, dict):
        return []
    nested = [v for v in scaling.values() if isinstance(v, dict)]
    return [scaling, *nested]


def _check_positive(key: str, value: Any) -> None:
    """A positive, finite number (None: not given), else one line naming ``key`` (a zero or NaN
    ``rope_theta`` or norm epsilon made NaN logits)."""
    if value is None:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise MlxformerError(f"config.json {key} must be a positive number, not {str(value)[:40]}")
