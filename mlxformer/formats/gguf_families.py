"""What each GGUF ``general.architecture`` is for the decoder: its HF ``model_type`` and the
config keys only that architecture has (llama.cpp's metadata keys, and the settings llama.cpp
hard-codes for it rather than writing them).

The tensor names of each architecture are rows of the one name table (``ARCH_TENSOR_NAMES``);
the shared keys (sizes, eps, rope base, linear rope scaling) are read by ``gguf.config_from_metadata``.
"""

from __future__ import annotations

from typing import Any, Callable

from mlxformer.errors import MlxformerError

# general.architecture -> HF model_type
GGUF_ARCHITECTURES = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma", "gemma2": "gemma2",
    "gemma3": "gemma3_text", "phi3": "phi3", "olmo2": "olmo2", "granite": "granite", "smollm3": "smollm3",
    "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe",  # llama + experts: mixtral
    "mistral3": "ministral3",  # olmo2 with a sliding window: olmo3
    "gpt-oss": "gpt_oss", "gemma4": "gemma4_text",
    "qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_next",  # Gated DeltaNet hybrids
    "glm4moe": "glm4_moe", "deepseek2": "deepseek_v3",  # deepseek2: DeepSeek-V2/V3, GLM-4.7-Flash (MLA)
    "gpt2": "gpt2",  # learned positions, LayerNorms (``attention.layer_norm_epsilon``)
}
# Architectures whose converter stored every RMSNorm weight as ``1 + weight`` (Gemma's offset).
NORM_SHIFTED_ARCHS = ("gemma", "gemma2", "gemma3")

# ``field(name, default)`` reads ``{arch}.{name}`` as a finite number (default when absent; a
# missing key without a default raises); ``field(name, None)`` is None when absent.
Field = Callable[[str, Any], Any]


def _gemma_scalar(field: Field, config: dict[str, Any], big_layers: int) -> float:
    """llama.cpp's Gemma 2/3 attention scale: 1/sqrt(head_dim), or 1/sqrt(hidden/heads) for
    the 27B (``big_layers`` blocks)."""
    if config["num_hidden_layers"] == big_layers:
        return config["hidden_size"] // config["num_attention_heads"]
    return config["head_dim"]


def _gemma2(field: Field, config: dict[str, Any]) -> dict[str, Any]:
    return {
        "attn_logit_softcapping": float(field("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(field("final_logit_softcapping", 30.0)),
        "sliding_window": int(field("attention.sliding_window", 4096)),
        "query_pre_attn_scalar": _gemma_scalar(field, config, 46),
    }


def _gemma3(field: Field, config: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp: every sixth layer global, the others sliding with an unscaled base (10k unless
    # ``rope.freq_base_swa`` says otherwise)
    extra: dict[str, Any] = {
        "sliding_window": int(field("attention.sliding_window", 4096)),
        "sliding_window_pattern": int(field("attention.sliding_window_pattern", 6)),
        "rope_local_base_freq": float(field("rope.freq_base_swa", 10000.0)),
        "query_pre_attn_scalar": _gemma_scalar(field, config, 62),
    }
    softcap = field("final_logit_softcapping", None)
    if softcap is not None:
        extra["final_logit_softcapping"] = float(softcap)
    return extra


def _phi3(field: Field, config: dict[str, Any]) -> dict[str, Any]:
    rotary = int(field("rope.dimension_count", config["head_dim"]))
    window = int(field("attention.sliding_window", 0))
    return {
        "partial_rotary_factor": rotary / config["head_dim"],
        "original_max_position_embeddings": int(field("rope.scaling.original_context_length",
                                                      config["max_position_embeddings"])),
        "sliding_window": window or None,  # 0: none (Phi-4)
    }


def _granite(field: Field, config: dict[str, Any]) -> dict[str, Any]:
    return {
        "embedding_multiplier": float(field("embedding_scale", 1.0)),
        "residual_multiplier": float(field("residual_scale", 1.0)),
        "attention_multiplier": float(field("attention.scale", config["head_dim"] ** -0.5)),
        "logits_scaling": float(field("logit_scale", 1.0)),
    }


def _olmo2(field: Field, config: dict[str, Any]) -> dict[str, Any]:
    """OLMo 3 is ``olmo2`` with a window (its per-layer pattern is read as ``layer_types``;
    llama.cpp's default is three sliding layers to one global)."""
    window = field("attention.sliding_window", None)
    if not window:
        return {}
    return {"model_type": "olmo3", "sliding_window": int(window)}


def _mistral3(field: Field, config: dict[str, Any]) -> dict[str, Any]:
    """Ministral 3: Llama 4's query scaling, its beta as ``attention.temperature_scale`` over the
    YaRN original context."""
    scaling = dict(config.get("rope_scaling") or {})
    scaling["llama_4_scaling_beta"] = float(field("attention.temperature_scale", 0.0))
    scaling.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    return {"rope_scaling": scaling}


def _experts(field: Field, config: dict[str, Any], norm_topk_prob: bool) -> dict[str, Any]:
    """The mixture-of-experts keys; llama.cpp hard-codes whether the top-k weights are renormalised."""
    return {
        "num_experts": int(field("expert_count")),
        "num_experts_per_tok": int(field("expert_used_count")),
        "moe_intermediate_size": int(field("expert_feed_forward_length", config["intermediate_size"])),
        "shared_expert_intermediate_size": int(field("expert_shared_feed_forward_length", 0)),
        "norm_topk_prob": norm_topk_prob,
    }


def _llama(field: Field, config: dict[str, Any]) -> dict[str, Any]:
    if field("expert_count", None) is None:
        return {}
    return {"model_type": "mixtral", **_experts(field, config, True)}


def _qwen2moe(field: Field, config: dict[str, Any]) -> dict[str, Any]:
    return _experts(field, config, False)


def _smollm3(field: Field, config: dict[str, Any]) -> dict[str, Any]:
    return {"no_rope_layer_interval": 4}  # llama.cpp: every fourth layer has no RoPE


def _gpt_oss(field: Field, config: dict[str, Any]) -> dict[str, Any]:
    """Experts, the sliding window, and YaRN's settings llama.cpp does not write: gpt-oss's
    config says ``truncate: false`` (beta_fast 32, beta_slow 1: the defaults)."""
    experts = _experts(field, config, False)
    rope = dict(config.get("rope_scaling") or {})
    if rope.get("rope_type") == "yarn":
        rope["truncate"] = False
    return {"num_local_experts": experts["num_experts"], "num_experts_per_tok": experts["num_experts_per_tok"],
            "intermediate_size": experts["moe_intermediate_size"], "attention_bias": True,
            "sliding_window": int(field("attention.sliding_window")), "rope_scaling": rope or None}


def _gated_delta(field: Field, config: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5 / Qwen3-Next: the DeltaNet sizes as llama.cpp's ``ssm.*`` keys (``time_step_rank``:
    value heads, ``group_count``: key heads, ``state_size``: key head dim, ``inner_size``: all
    value features), the recurrent layers, the rotated share of the head dim."""
    layers, value_heads = config["num_hidden_layers"], int(field("ssm.time_step_rank"))
    interval = int(field("full_attention_interval", 4))  # llama.cpp's rule without a recurrent_layers key
    written = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    return {
        "layer_types": config.get("layer_types") or written,  # ``recurrent_layers``, read by ``config_from_metadata``
        "linear_num_key_heads": int(field("ssm.group_count")), "linear_num_value_heads": value_heads,
        "linear_key_head_dim": int(field("ssm.state_size")),
        "linear_value_head_dim": int(field("ssm.inner_size")) // max(value_heads, 1),
        "linear_conv_kernel_dim": int(field("ssm.conv_kernel")),
        "partial_rotary_factor": int(field("rope.dimension_count", config["head_dim"])) / config["head_dim"],
    }


def _gated_delta_moe(field: Field, config: dict[str, Any]) -> dict[str, Any]:
    return {**_gated_delta(field, config), **_experts(field, config, True)}


_ARCH_KEYS: dict[str, Callable[[Field, dict[str, Any]], dict[str, Any]]] = {
    "gemma2": _gemma2, "gemma3": _gemma3, "phi3": _phi3, "granite": _granite, "smollm3": _smollm3,
    "llama": _llama, "qwen2moe": _qwen2moe, "olmo2": _olmo2, "mistral3": _mistral3,
    "qwen3moe": lambda field, config: _experts(field, config, True),
    "olmoe": lambda field, config: _experts(field, config, False),
    "gpt-oss": _gpt_oss,
    "qwen35": _gated_delta, "qwen35moe": _gated_delta_moe, "qwen3next": _gated_delta_moe,
}


# llama.cpp's ``expert_gating_func`` values
GATING_SOFTMAX, GATING_SIGMOID = 1, 2


def _routed(field: Field) -> dict[str, Any]:
    """DeepSeek-style experts (``models.router``): shared experts, leading dense layers, groups,
    the renormalisation and scale of the chosen weights (llama.cpp's defaults when absent)."""
    return {
        "n_routed_experts": int(field("expert_count")),
        "num_experts_per_tok": int(field("expert_used_count")),
        "moe_intermediate_size": int(field("expert_feed_forward_length")),
        "n_shared_experts": int(field("expert_shared_count", 0)),
        "first_k_dense_replace": int(field("leading_dense_block_count", 0)),
        "routed_scaling_factor": float(field("expert_weights_scale", 1.0)),
        "norm_topk_prob": field("expert_weights_norm", False),
        "n_group": int(field("expert_group_count", 1)),
        "topk_group": int(field("expert_group_used_count", 1)),
    }


def _has(tensors: frozenset[str], suffix: str) -> bool:
    return any(name.endswith(suffix) for name in tensors)


def _glm4moe(field: Field, config: dict[str, Any], tensors: frozenset[str]) -> dict[str, Any]:
    """GLM-4.5/4.6: partial rotary (``rope.dimension_count``), q/k/v biases and q/k norms when
    the file has them, sigmoid-routed experts."""
    if field("expert_gating_func", GATING_SIGMOID) != GATING_SIGMOID:
        raise MlxformerError("GGUF glm4moe with a router other than sigmoid is not supported")
    return {"partial_rotary_factor": int(field("rope.dimension_count", config["head_dim"])) / config["head_dim"],
            "attention_bias": _has(tensors, ".attn_q.bias"), "use_qk_norm": _has(tensors, ".attn_q_norm.weight"),
            **_routed(field)}


def _deepseek2(field: Field, config: dict[str, Any], tensors: frozenset[str]) -> dict[str, Any]:
    """Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash). The converter writes MLA as
    one KV head of ``kv_lora_rank + rope`` features; the per-head sizes are the ``_mla`` keys.
    A sigmoid router (``expert_gating_func`` 2, or no key and a correction bias: llama.cpp
    itself guesses softmax there unless the sizes are GLM-4.7-Flash's) is DeepSeek-V3's
    ``noaux_tc``; softmax is V2's, group-limited when there are groups. DeepSeek's
    ``yarn_log_multiplier`` is written as 0.1 * ``mscale_all_dim``."""
    rope = int(field("rope.dimension_count"))
    key_length = int(field("attention.key_length_mla", config["head_dim"]))  # older files: key_length
    q_lora = field("attention.q_lora_rank", None)
    routed = _routed(field)
    gating = field("expert_gating_func", None)
    if gating is None:
        gating = GATING_SIGMOID if _has(tensors, ".exp_probs_b.bias") else GATING_SOFTMAX
    if gating not in (GATING_SOFTMAX, GATING_SIGMOID):
        raise MlxformerError(f"GGUF deepseek2 expert_gating_func {gating} is not supported (1 softmax, 2 sigmoid)")
    extra: dict[str, Any] = {
        "model_type": "deepseek_v3" if gating == GATING_SIGMOID else "deepseek_v2",
        "num_key_value_heads": config["num_attention_heads"],
        "kv_lora_rank": int(field("attention.kv_lora_rank")), "q_lora_rank": None if q_lora is None else int(q_lora),
        "qk_rope_head_dim": rope, "qk_nope_head_dim": key_length - rope,
        "v_head_dim": int(field("attention.value_length_mla", field("attention.value_length"))),
        "attention_bias": _has(tensors, ".attn_kv_a_mqa.bias"), **routed,
    }
    if gating == GATING_SOFTMAX:
        extra["topk_method"] = "group_limited_greedy" if routed["n_group"] > 1 else "greedy"
    scaling = config.get("rope_scaling")
    if scaling and "mscale_all_dim" in scaling:
        extra["rope_scaling"] = {**scaling, "mscale": scaling["mscale"] / 0.1,
                                 "mscale_all_dim": scaling["mscale_all_dim"] / 0.1}
    return extra


# Readers that also look at which tensors the file has (optional biases and norms).
_ARCH_TENSOR_KEYS: dict[str, Callable[[Field, dict[str, Any], frozenset[str]], dict[str, Any]]] = {
    "glm4moe": _glm4moe, "deepseek2": _deepseek2,
}


def gemma4_config(field: Field, config: dict[str, Any], array: Callable[[str], Any], tensor_names: set[str]) -> dict[str, Any]:
    """Gemma 4's keys: per-layer K/V heads and feed-forward lengths as arrays (``array``: the
    raw metadata value), the two head sizes, K = V where a full layer has no ``attn_v``; the
    proportional RoPE's rotated share comes from ``rope_freqs`` (``gguf.open_gguf``)."""
    types = config["layer_types"]
    layers = len(types)
    shared = int(field("attention.shared_kv_layers", 0))
    full = next(i for i, t in enumerate(types) if t == "full_attention")
    sliding = next((i for i, t in enumerate(types) if t == "sliding_attention"), full)

    def at(name: str, index: int, default: Any) -> int:
        value = array(name)
        return int(default if value is None else value[index] if isinstance(value, list) else value)

    ff = array("feed_forward_length")
    global_head_dim = int(field("attention.key_length"))
    extra: dict[str, Any] = {
        "head_dim": int(field("attention.key_length_swa", global_head_dim)), "global_head_dim": global_head_dim,
        "num_key_value_heads": at("attention.head_count_kv", sliding, config["num_attention_heads"]),
        "num_global_key_value_heads": at("attention.head_count_kv", full, config["num_attention_heads"]),
        "attention_k_eq_v": any(f"blk.{i}.attn_v.weight" not in tensor_names
                                for i in range(layers - shared) if types[i] == "full_attention"),
        "intermediate_size": at("feed_forward_length", 0, 0),
        "use_double_wide_mlp": isinstance(ff, list) and len(set(ff)) > 1,
        "sliding_window": int(field("attention.sliding_window")), "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": int(field("embedding_length_per_layer_input", 0)),
        "vocab_size_per_layer_input": config["vocab_size"],
        "final_logit_softcapping": field("final_logit_softcapping", None),
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": float(field("rope.freq_base_swa", 10000.0))},
            "full_attention": {"rope_type": "proportional", "rope_theta": float(field("rope.freq_base", 1e6)),
                               "partial_rotary_factor": 1.0}},
    }
    if field("expert_count", None):
        extra.update(enable_moe_block=True, num_experts=int(field("expert_count")),
                     top_k_experts=int(field("expert_used_count")),
                     moe_intermediate_size=int(field("expert_feed_forward_length")))
    return extra


def arch_config(arch: str, field: Field, config: dict[str, Any], tensors: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The config.json keys of ``arch`` beyond the shared ones already in ``config`` (``tensors``:
    the file's tensor names)."""
    if arch in _ARCH_TENSOR_KEYS:
        return _ARCH_TENSOR_KEYS[arch](field, config, tensors)
    reader = _ARCH_KEYS.get(arch)
    return reader(field, config) if reader else {}
