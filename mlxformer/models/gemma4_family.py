"""Gemma 4 (``gemma4_text``; the image-text ``gemma4`` through its ``text_config``): its
config.json keys as fields of the one decoder, and back.

Gemma 3's sandwich norms, GeGLU, q/k norms and sliding/full layers, plus: "full" layers with
their own head size (``global_head_dim``), K/V head count and keys that are also the values
(``attention_k_eq_v``), a scale-free norm on the values, an attention scale of 1, "proportional"
RoPE on full layers, plain ``w`` (not ``1 + w``) RMSNorms, a stored scalar per layer, per-layer
token inputs (``hidden_size_per_layer_input``), the last ``num_kv_shared_layers`` layers reading
the keys/values of an earlier layer of their type, a double-wide MLP on those (``use_double_wide_mlp``)
and a routed experts block beside the MLP (``enable_moe_block``).
"""

from __future__ import annotations

import math
from typing import Any

from mlxformer.errors import MlxformerError
from mlxformer.models.family_keys import Fields, activation, float_or_none, layer_types, window
from mlxformer.models.rope_config import RopeConfig, rope_config_from_dict, rope_scaling_dict

# transformers' defaults when a config.json leaves them out
_ROPE_DEFAULTS = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                  "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                     "rope_theta": 1_000_000.0}}


def _rope(config: dict[str, Any], base: Fields, layer_type: str) -> RopeConfig:
    params = (config.get("rope_parameters") or _ROPE_DEFAULTS).get(layer_type) or _ROPE_DEFAULTS[layer_type]
    return rope_config_from_dict({"rope_parameters": params, "max_position_embeddings": base["max_position_embeddings"]})


def _global_sizes(config: dict[str, Any], types: tuple[str, ...], base: Fields) -> tuple[int, int]:
    """The head size and K/V head count of the full layers: transformers 5's saved
    ``per_layer_config`` (one override for every full layer, none for sliding ones), or the
    hub's ``global_head_dim`` (default 512) and, with ``attention_k_eq_v``, ``num_global_key_value_heads``."""
    per_layer = config.get("per_layer_config")
    if per_layer:
        overrides = {int(k): v for k, v in per_layer.items()}
        full = [overrides.get(i) for i, t in enumerate(types) if t == "full"]
        sliding = [overrides.get(i) for i, t in enumerate(types) if t == "sliding"]
        if any(o != full[0] for o in full) or any(sliding) or not full[0]:
            raise MlxformerError("unsupported gemma4 per_layer_config: only one override for every full layer")
        return (int(full[0].get("head_dim", base["head_dim"])),
                int(full[0].get("num_key_value_heads", base["num_key_value_heads"])))
    head_dim = int(config.get("global_head_dim") or 512)
    heads = config.get("num_global_key_value_heads") if config.get("attention_k_eq_v") else None
    return head_dim, int(heads or base["num_key_value_heads"])


def gemma4_fields(config: dict[str, Any], base: Fields) -> Fields:
    """The ``ModelArgs`` fields of a ``gemma4_text`` config.json."""
    if config.get("use_bidirectional_attention"):
        raise MlxformerError("unsupported gemma4 setting use_bidirectional_attention (not a causal LM)")
    layers = int(config["num_hidden_layers"])
    types = list(layer_types(config, lambda i: (i + 1) % 6 != 0))
    types[-1] = "full"  # transformers forces the last layer global
    shared = int(config.get("num_kv_shared_layers") or 0)
    if not 0 <= shared < layers or not set(types[shared and layers - shared:]) <= set(types[: layers - shared]):
        raise MlxformerError(f"config.json num_kv_shared_layers must leave a layer of each shared type, not {shared}")
    head_dim, kv_heads = _global_sizes(config, tuple(types), base)
    per_layer = int(config.get("hidden_size_per_layer_input") or 0)
    fields: Fields = {
        "hidden_act": activation(config, "gelu_pytorch_tanh", "hidden_activation", "hidden_act"),
        "embedding_scale": math.sqrt(base["hidden_size"]),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", True)),
        "norm_layout": "sandwich", "qk_norm": True, "v_norm": True, "attention_scale": 1.0,
        "final_logit_softcap": float_or_none(config.get("final_logit_softcapping")),
        "sliding_window": window(config) or 512, "layer_types": tuple(types),
        "rope": _rope(config, base, "full_attention"), "rope_local": _rope(config, base, "sliding_attention"),
        "global_head_dim": head_dim, "global_kv_heads": kv_heads,
        "attention_k_eq_v": bool(config.get("attention_k_eq_v", False)), "layer_scalar": True,
        "hidden_size_per_layer_input": per_layer,
        "vocab_size_per_layer_input": int(config.get("vocab_size_per_layer_input") or base["vocab_size"]) if per_layer else 0,
        "num_kv_shared_layers": shared, "double_wide_mlp": bool(config.get("use_double_wide_mlp", False)),
    }
    if config.get("enable_moe_block"):
        count, top_k = int(config["num_experts"]), int(config["top_k_experts"])
        if not 0 < top_k <= count:
            raise MlxformerError(f"config.json top_k_experts must be 1..{count}, not {top_k}")
        fields.update(experts_beside_mlp=True, num_experts=count, num_experts_per_tok=top_k, norm_topk_prob=True,
                      moe_intermediate_size=int(config["moe_intermediate_size"]))
    return fields


def gemma4_config(args: Any) -> dict[str, Any]:
    """The config.json keys of the Gemma 4 fields of ``args`` (a ``ModelArgs``), as transformers
    and mlx-lm read them."""
    def params(rope: RopeConfig) -> dict[str, Any]:
        scaling = rope_scaling_dict(rope) or {"rope_type": "default"}
        scaling.pop("type", None)
        if rope.type == "proportional" and rope.factor == 1.0:
            scaling.pop("factor", None)
        return {**scaling, "rope_theta": rope.theta}

    config = {
        "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": args.final_logit_softcap,
        "rope_parameters": {"full_attention": params(args.rope), "sliding_attention": params(args.rope_local)},
        "global_head_dim": args.global_head_dim, "num_global_key_value_heads": args.global_kv_heads,
        "attention_k_eq_v": args.attention_k_eq_v, "hidden_size_per_layer_input": args.hidden_size_per_layer_input,
        "vocab_size_per_layer_input": args.vocab_size_per_layer_input,
        "num_kv_shared_layers": args.num_kv_shared_layers, "use_double_wide_mlp": args.double_wide_mlp,
        "enable_moe_block": args.experts_beside_mlp,
    }
    if args.experts_beside_mlp:
        config.update(num_experts=args.num_experts, top_k_experts=args.num_experts_per_tok,
                      moe_intermediate_size=args.moe_intermediate_size)
    return config

