"""Each family's config.json keys, mapped onto the one decoder's ``ModelArgs`` fields.

``ModelArgs.from_dict`` reads what every family shares (sizes, eps, RoPE, Llama-style biases);
the reader of a ``model_type`` here returns only the fields where that family differs. A
family is a row of this table, never a copy of the decoder.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from mlxformer.errors import MlxformerError
from mlxformer.models.family_keys import Fields, activation, float_or_none, layer_types, window
from mlxformer.models.gemma4_family import gemma4_fields
from mlxformer.models.gpt2_family import gpt2_config, gpt2_fields
from mlxformer.models.rope_config import RopeConfig, rope_config_from_dict, yarn_mscale


def _llama(config: dict[str, Any], base: Fields) -> Fields:
    return {}


def _mistral(config: dict[str, Any], base: Fields) -> Fields:
    return {"sliding_window": window(config)}


def _qwen2(config: dict[str, Any], base: Fields) -> Fields:
    # q/k/v biases, never an o_proj bias; its sliding_window is inactive without use_sliding_window
    return {"qkv_bias": True, "o_proj_bias": False}


def _qwen3(config: dict[str, Any], base: Fields) -> Fields:
    return {"qk_norm": True}


def _gemma(config: dict[str, Any], base: Fields) -> Fields:
    """GeGLU, ``(1 + w)`` RMSNorms, embeddings scaled by sqrt(hidden), tied output."""
    return {
        "hidden_act": activation(config, "gelu_pytorch_tanh", "hidden_activation", "hidden_act"),
        "norm_offset": 1.0,
        "embedding_scale": math.sqrt(base["hidden_size"]),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", True)),
    }


def _gemma2(config: dict[str, Any], base: Fields) -> Fields:
    """Gemma plus four norms a layer, query_pre_attn_scalar, soft-capping, alternating windows."""
    return {
        **_gemma(config, base),
        "norm_layout": "sandwich",
        "attention_scale": float(config.get("query_pre_attn_scalar") or 256) ** -0.5,
        "attn_logit_softcap": float_or_none(config.get("attn_logit_softcapping", 50.0)),
        "final_logit_softcap": float_or_none(config.get("final_logit_softcapping", 30.0)),
        "sliding_window": window(config),
        "layer_types": layer_types(config, lambda i: i % 2 == 0),
    }


def _gemma3(config: dict[str, Any], base: Fields) -> Fields:
    """Gemma 2 without soft-capping by default, per-head q/k norms, five sliding layers to one
    global, and a local RoPE (base 10k, unscaled) for the sliding layers."""
    pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6)
    params = config.get("rope_parameters") or {}
    if isinstance(params.get("sliding_attention"), dict):
        local = rope_config_from_dict({"rope_parameters": params["sliding_attention"],
                                       "max_position_embeddings": base["max_position_embeddings"]})
    else:
        local = RopeConfig(theta=float(config.get("rope_local_base_freq", 10000.0)))
    return {
        **_gemma2(config, base),
        "attn_logit_softcap": float_or_none(config.get("attn_logit_softcapping")),
        "final_logit_softcap": float_or_none(config.get("final_logit_softcapping")),
        "qk_norm": True,
        "rope_local": local,
        "layer_types": layer_types(config, lambda i: (i + 1) % pattern != 0),
    }


def _phi3(config: dict[str, Any], base: Fields) -> Fields:
    """Fused qkv_proj and gate_up_proj, partial rotary dimensions, LongRoPE, a sliding window."""
    params = config.get("rope_parameters") or {}
    factor = config.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    return {"fused_qkv": True, "fused_gate_up": True, "partial_rotary_factor": float(factor),
            "sliding_window": window(config)}


def _granite(config: dict[str, Any], base: Fields) -> Fields:
    """Embedding, residual, attention and logits multipliers."""
    return {
        "embedding_scale": float(config.get("embedding_multiplier", 1.0)),
        "residual_scale": float(config.get("residual_multiplier", 1.0)),
        "attention_scale": float(config.get("attention_multiplier", base["head_dim"] ** -0.5)),
        "logits_scale": 1.0 / float(config.get("logits_scaling", 1.0)),
    }


def _olmo2(config: dict[str, Any], base: Fields) -> Fields:
    """Norms after each sublayer, q/k RMSNorm over the whole projection."""
    return {"norm_layout": "post", "qk_norm": True, "qk_norm_scope": "projection"}


def _layer_type_rope(config: dict[str, Any], base: Fields, layer_type: str) -> RopeConfig:
    """The RoPE of one layer type when ``rope_parameters`` is keyed by layer type (transformers 5's
    Gemma 3, OLMo 3); else the classic ``rope_theta`` unscaled (``rope_scaling`` is the full layers')."""
    params = config.get("rope_parameters") or {}
    if isinstance(params.get(layer_type), dict):
        return rope_config_from_dict({"rope_parameters": params[layer_type],
                                      "max_position_embeddings": base["max_position_embeddings"]})
    return RopeConfig(theta=float(config.get("rope_theta", params.get("rope_theta", 10000.0))))


def _olmo3(config: dict[str, Any], base: Fields) -> Fields:
    """OLMo 2 with sliding-window layers (three to one global by default), whose RoPE is unscaled."""
    return {**_olmo2(config, base), "sliding_window": window(config) or 4096,
            "layer_types": layer_types(config, lambda i: (i + 1) % 4 != 0),
            "rope_local": _layer_type_rope(config, base, "sliding_attention")}


def _ministral3(config: dict[str, Any], base: Fields) -> Fields:
    """Mistral with YaRN and Llama 4's position-dependent query scaling (``llama_4_scaling_beta``
    over ``original_max_position_embeddings``); mlx-lm's config may list ``layer_types``."""
    params = {**(config.get("rope_parameters") or {}), **(config.get("rope_scaling") or {})}
    beta = float(params.get("llama_4_scaling_beta") or 0.0)
    fields: Fields = {**_mistral(config, base), "query_scale_beta": beta,
                      "query_scale_length": int(params.get("original_max_position_embeddings") or 1)}
    if config.get("layer_types") is not None:
        fields["layer_types"] = layer_types(config, lambda i: False)
    return fields


def _smollm3(config: dict[str, Any], base: Fields) -> Fields:
    """Every ``no_rope_layer_interval``-th layer has no RoPE (``no_rope_layers``: 1 = RoPE)."""
    layers = int(config["num_hidden_layers"])
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = int(config.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers:
        raise MlxformerError(f"config.json no_rope_layers must have {layers} entries, not {len(flags)}")
    return {"rope_layers": tuple(bool(f) for f in flags)}


def _experts(config: dict[str, Any], size_key: str, norm_default: bool) -> Fields:
    """The mixture-of-experts fields shared by the MoE families (``models.moe``). The expert
    count is ``num_experts`` or ``num_local_experts`` (Mixtral; transformers 5's Qwen3-MoE)."""
    count_key = "num_experts" if config.get("num_experts") else "num_local_experts"
    count, top_k = int(config[count_key]), int(config["num_experts_per_tok"])
    if not 0 < top_k <= count:
        raise MlxformerError(f"config.json num_experts_per_tok must be 1..{count}, not {top_k}")
    layers = int(config["num_hidden_layers"])
    dense = tuple(int(i) for i in config.get("mlp_only_layers") or ())
    if any(not 0 <= i < layers for i in dense):
        raise MlxformerError(f"config.json mlp_only_layers must name layers 0..{layers - 1}")
    return {
        "mlp_type": "moe", "num_experts": count, "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(config[size_key]),
        "norm_topk_prob": bool(config.get("norm_topk_prob", norm_default)),
        "shared_expert_intermediate_size": int(config.get("shared_expert_intermediate_size") or 0),
        "decoder_sparse_step": max(1, int(config.get("decoder_sparse_step") or 1)),
        "mlp_only_layers": dense,
    }


def _mixtral(config: dict[str, Any], base: Fields) -> Fields:
    """Mistral with a sparse block named ``block_sparse_moe`` (experts w1/w2/w3), top-k renormalised."""
    return {**_mistral(config, base), **_experts(config, "intermediate_size", True),
            "norm_topk_prob": True, "mlp_name": "block_sparse_moe"}


def _qwen2_moe(config: dict[str, Any], base: Fields) -> Fields:
    """Qwen2 with routed experts and a sigmoid-gated shared expert."""
    return {**_qwen2(config, base), **_experts(config, "moe_intermediate_size", False)}


def _qwen3_moe(config: dict[str, Any], base: Fields) -> Fields:
    """Qwen3 with routed experts."""
    return {**_qwen3(config, base), **_experts(config, "moe_intermediate_size", False)}


def _olmoe(config: dict[str, Any], base: Fields) -> Fields:
    """Llama's layout with q/k RMSNorm over the whole projection and routed experts."""
    if config.get("clip_qkv") is not None:
        raise MlxformerError("unsupported config setting clip_qkv for olmoe")
    return {"qk_norm": True, "qk_norm_scope": "projection",
            **_experts(config, "intermediate_size", False)}


def _gpt_oss(config: dict[str, Any], base: Fields) -> Fields:
    """Attention sinks, biased q/k/v/o, sliding and full layers alternating, YaRN (read with
    the shared RoPE), and experts routed by softmax over the top-k logits with the clamped SwiGLU."""
    if (float(config.get("swiglu_alpha", 1.702)), float(config.get("swiglu_limit", 7.0))) != (1.702, 7.0):
        raise MlxformerError("unsupported gpt_oss swiglu_alpha/swiglu_limit (only 1.702/7.0)")
    bias = bool(config.get("attention_bias", True))
    return {**_experts(config, "intermediate_size", False), "mlp_type": "moe_topk_softmax",
            "hidden_act": "swiglu_clamped", "attention_sinks": True, "qkv_bias": bias, "o_proj_bias": bias,
            "sliding_window": window(config), "layer_types": layer_types(config, lambda i: i % 2 == 0)}


def _routed(config: dict[str, Any], router: str, norm_default: bool) -> Fields:
    """DeepSeek-style experts (``models.router``): ``n_routed_experts`` behind the grouped router,
    ``n_shared_experts`` always on, and dense MLPs on the first ``first_k_dense_replace`` layers
    (or on ``mlp_layer_types``' "dense" ones, GLM-4.7-Flash)."""
    layers = int(config["num_hidden_layers"])
    count = int(config.get("n_routed_experts") or config.get("num_local_experts") or 0)
    top_k = int(config["num_experts_per_tok"])
    if not 0 < top_k <= count:
        raise MlxformerError(f"config.json num_experts_per_tok must be 1..{count}, not {top_k}")
    n_group, topk_group = int(config.get("n_group") or 1), int(config.get("topk_group") or 1)
    if router != "greedy" and (count % n_group or not 0 < topk_group <= n_group):
        raise MlxformerError(f"config.json n_group {n_group} must divide {count} experts and topk_group "
                             f"{topk_group} be 1..{n_group}")
    kinds = config.get("mlp_layer_types")
    if kinds is not None:
        if len(kinds) != layers or any(k not in ("dense", "sparse") for k in kinds):
            raise MlxformerError(f"config.json mlp_layer_types must name {layers} layers as dense/sparse")
        dense = tuple(i for i, k in enumerate(kinds) if k == "dense")
    else:
        dense = tuple(range(min(layers, int(config.get("first_k_dense_replace") or 0))))
    return {
        "mlp_type": "moe", "num_experts": count, "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(config["moe_intermediate_size"]),
        "norm_topk_prob": bool(config.get("norm_topk_prob", norm_default)), "mlp_only_layers": dense,
        "router": router, "n_group": n_group, "topk_group": topk_group,
        "routed_scaling_factor": float(config.get("routed_scaling_factor") or 1.0),
        "n_shared_experts": int(config.get("n_shared_experts") or 0),
        "mtp_layers": int(config.get("num_nextn_predict_layers") or 0),
    }


def _glm4_moe(config: dict[str, Any], base: Fields) -> Fields:
    """GLM-4.5/4.6: q/k/v biases (never o_proj's), optional per-head q/k norm, half the head
    rotated, and sigmoid-routed experts with shared ones."""
    params = config.get("rope_parameters") or {}
    factor = config.get("partial_rotary_factor", params.get("partial_rotary_factor", 0.5))
    return {"qkv_bias": bool(config.get("attention_bias", False)), "o_proj_bias": False,
            "qk_norm": bool(config.get("use_qk_norm", False)), "partial_rotary_factor": float(factor),
            **_routed(config, "noaux_tc", True)}


def _mla(config: dict[str, Any], base: Fields) -> Fields:
    """Multi-head latent attention (``models.mla``): low-rank q (``q_lora_rank``; None: plain
    q_proj) and kv projections, decoupled rope dims, ``v_head_dim`` values; the softmax scale is
    ``qk_head_dim ** -0.5`` times YaRN's ``mscale(factor, mscale_all_dim) ** 2``."""
    nope, rope_dims = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
    scaling = {**(config.get("rope_parameters") or {}), **(config.get("rope_scaling") or {})}
    scale = (nope + rope_dims) ** -0.5
    if (scaling.get("rope_type") or scaling.get("type") or "default") != "default" and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    q_lora = config.get("q_lora_rank")
    return {
        "attention_type": "mla", "q_lora_rank": None if q_lora is None else int(q_lora),
        "kv_lora_rank": int(config["kv_lora_rank"]), "qk_rope_head_dim": rope_dims, "qk_nope_head_dim": nope,
        "v_head_dim": int(config["v_head_dim"]), "head_dim": rope_dims, "attention_scale": scale,
        "rope_traditional": bool(config.get("rope_interleave", True)),
        "qkv_bias": bool(config.get("attention_bias", False)), "o_proj_bias": bool(config.get("attention_bias", False)),
    }


def _deepseek_v2(config: dict[str, Any], base: Fields) -> Fields:
    """DeepSeek-V2: MLA, softmax routing (``greedy`` or ``group_limited_greedy``), never renormalised."""
    method = config.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise MlxformerError(f"unsupported topk_method {method!r} for deepseek_v2")
    return {**_mla(config, base), "rope_traditional": True, **_routed(config, method, False), "norm_topk_prob": False}


def _deepseek_v3(config: dict[str, Any], base: Fields) -> Fields:
    """DeepSeek-V3 and GLM-4.7-Flash (``glm4_moe_lite``): MLA and sigmoid (``noaux_tc``) routing."""
    return {**_mla(config, base), **_routed(config, "noaux_tc", True)}


# Qwen3.5/3.6 ship as image-text models: the language model's settings sit under ``text_config``.
_TEXT_CONFIG_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "gemma4": "gemma4_text"}
_HYBRID_LAYERS = {"linear_attention": "linear", "full_attention": "full"}


def text_config_of(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config under the shared key names: an image-text Qwen3.5's
    ``text_config`` over its top level (as the text model type), GPT-2's with its own size keys
    also under the shared names, any other config as it is."""
    inner = _TEXT_CONFIG_TYPES.get(config.get("model_type"))  # type: ignore[arg-type]
    if inner is None:
        return gpt2_config(config)
    outer = {k: v for k, v in config.items() if k not in ("text_config", "vision_config", "audio_config")}
    return {**outer, **(config.get("text_config") or {}), "model_type": inner}


def head_fields(config: dict[str, Any]) -> Fields:
    """What the model outputs, from its architecture: vocabulary logits (``*ForCausalLM``),
    a classifier's (``*ForSequenceClassification``: a cross-encoder's ``score``) or, for a
    base model (``*Model``, not GPT-2's ``GPT2LMHeadModel``) without tied embeddings, hidden
    states only."""
    architecture = str((config.get("architectures") or [""])[0])
    if architecture.endswith("ForSequenceClassification"):
        labels = config.get("id2label")
        return {"head": "score", "num_labels": int(config.get("num_labels") or (len(labels) if labels else 2))}
    base = architecture.endswith("Model") and not architecture.endswith("LMHeadModel")
    if base and not config.get("tie_word_embeddings", False):
        return {"head": "none"}
    return {}


def head_config(args: Any, base: str) -> dict[str, Any]:
    """The ``config.json`` keys ``head_fields`` (and ``use_bidirectional_attention``) read back;
    ``base``: the family's causal LM architecture."""
    keys: dict[str, Any] = {"use_bidirectional_attention": args.bidirectional} if args.bidirectional else {}
    if args.head == "score":
        keys.update(architectures=[base.replace("ForCausalLM", "ForSequenceClassification")], num_labels=args.num_labels)
    elif args.head == "none":
        keys["architectures"] = [base.replace("ForCausalLM", "Model")]
    return keys


# Set by the checkpoint reader (``mlx_lm_layout.with_stored_layout``), never written: the weights are stored as
# mlx-lm stores a Gated DeltaNet model (conv1d ``(C, K, 1)``, the ``(1 + w)`` norms' 1 folded in).
MLX_LM_LAYOUT = "_mlx_lm_gated_delta_layout"


def _gated_delta(config: dict[str, Any], base: Fields) -> Fields:
    """Qwen3.5 / Qwen3-Next: Gated DeltaNet layers (``models.gated_delta``) with every
    ``full_attention_interval``-th layer gated attention (output gate from ``q_proj``), per-head
    q/k norms, ``(1 + w)`` RMSNorms and partial rotary dimensions."""
    layers = int(config["num_hidden_layers"])
    written = config.get("layer_types")
    if written is None:
        interval = int(config.get("full_attention_interval") or 4)
        written = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if len(written) != layers or any(t not in _HYBRID_LAYERS for t in written):
        raise MlxformerError(f"config.json layer_types must name {layers} layers as linear_attention/full_attention")
    key_heads, value_heads = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
    if value_heads % key_heads:
        raise MlxformerError(f"linear_num_value_heads ({value_heads}) must be a multiple of linear_num_key_heads ({key_heads})")
    params = config.get("rope_parameters") or {}
    factor = config.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    mlx_lm = bool(config.get(MLX_LM_LAYOUT))
    return {
        "qk_norm": True, "norm_offset": 0.0 if mlx_lm else 1.0, "linear_conv_channels_last": mlx_lm,
        "attn_output_gate": True, "partial_rotary_factor": float(factor),
        "layer_types": tuple(_HYBRID_LAYERS[t] for t in written),
        "linear_num_key_heads": key_heads, "linear_num_value_heads": value_heads,
        "linear_key_head_dim": int(config["linear_key_head_dim"]),
        "linear_value_head_dim": int(config["linear_value_head_dim"]),
        "linear_conv_kernel_dim": int(config.get("linear_conv_kernel_dim") or 4),
    }


def _qwen3_5_moe(config: dict[str, Any], base: Fields) -> Fields:
    """Qwen3.5 with routed experts (top-k always renormalised) and the gated shared expert."""
    return {**_gated_delta(config, base), **_experts(config, "moe_intermediate_size", True), "norm_topk_prob": True}


def _qwen3_next(config: dict[str, Any], base: Fields) -> Fields:
    """Qwen3.5-MoE's layout with the DeltaNet projections fused per key head."""
    return {**_gated_delta(config, base), **_experts(config, "moe_intermediate_size", True),
            "linear_fused_projections": True}


def hybrid_config(args: Any) -> dict[str, Any]:
    """The config.json keys of the Gated DeltaNet fields of ``args`` (a ``ModelArgs``)."""
    names = {short: long for long, short in _HYBRID_LAYERS.items()}
    return {
        "layer_types": [names[t] for t in args.layer_types], "partial_rotary_factor": args.partial_rotary_factor,
        "linear_num_key_heads": args.linear_num_key_heads, "linear_num_value_heads": args.linear_num_value_heads,
        "linear_key_head_dim": args.linear_key_head_dim, "linear_value_head_dim": args.linear_value_head_dim,
        "linear_conv_kernel_dim": args.linear_conv_kernel_dim,
    }


FAMILIES: dict[str, Callable[[dict[str, Any], Fields], Fields]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3,
    "phi3": _phi3,
    "granite": _granite,
    "olmo2": _olmo2,
    "smollm3": _smollm3,
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "olmoe": _olmoe,
    "gpt_oss": _gpt_oss,
    "glm4_moe": _glm4_moe,
    "deepseek_v2": _deepseek_v2,
    "deepseek_v3": _deepseek_v3,
    "glm4_moe_lite": _deepseek_v3,
    "ministral3": _ministral3,
    "olmo3": _olmo3,
    "qwen3_5_text": _gated_delta,
    "qwen3_5_moe_text": _qwen3_5_moe,
    "qwen3_next": _qwen3_next,
    "gemma4_text": gemma4_fields,
    "gpt2": gpt2_fields,
}


def family_fields(config: dict[str, Any], base: Fields) -> Fields:
    """The ``ModelArgs`` fields where ``config``'s family differs from ``base`` (the shared reading)."""
    return FAMILIES[config["model_type"]](config, base)
