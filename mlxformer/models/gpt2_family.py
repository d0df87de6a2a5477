"""GPT-2 (``gpt2``) as fields of the one decoder, and its checkpoint names as the decoder's.

GPT-2 is the decoder with learned absolute positions (``position_type="learned"``: ``wpe``),
LayerNorms with a bias, a plain (ungated) GELU-tanh MLP, one fused ``c_attn`` projection,
biases on every projection and a tied output. Its config names the sizes ``n_embd``,
``n_layer``, ``n_head``, ``n_positions``, ``n_inner``; its checkpoints name the weights
``transformer.h.N.attn.c_attn`` and store each projection as a ``Conv1D``, ``(in, out)``:
``formats.gpt2_names`` renames and transposes them. mlx-lm's ``gpt2`` config keys are added
here (``mlx_lm_gpt2_config``) when ``convert`` writes its layout.
"""

from __future__ import annotations

from typing import Any

from mlxformer.errors import MlxformerError

# GPT-2's config keys -> the shared ones (a key already present wins: a config written back)
_CONFIG_KEYS = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
                "n_positions": "max_position_embeddings", "layer_norm_epsilon": "rms_norm_eps"}
_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu_tanh")  # transformers' tanh-approximated GELUs

def gpt2_config(config: dict[str, Any]) -> dict[str, Any]:
    """A ``gpt2`` config.json with the shared key names added (``intermediate_size``: ``n_inner``
    or 4 x ``n_embd``); other configs as they are."""
    if config.get("model_type") != "gpt2":
        return config
    shared = {new: config[old] for old, new in _CONFIG_KEYS.items() if old in config and new not in config}
    out = {**config, **shared}
    if "intermediate_size" not in out and "hidden_size" in out:
        out["intermediate_size"] = config.get("n_inner") or 4 * out["hidden_size"]
    return out


def mlx_lm_gpt2_config(config: dict[str, Any]) -> dict[str, Any]:
    """A ``gpt2`` config written with the shared keys, with GPT-2's own keys that mlx-lm's
    ``gpt2`` reads (``n_ctx``, ``n_embd``, ...) added where missing (a GGUF source has none)."""
    own = {old: config[new] for old, new in _CONFIG_KEYS.items() if new in config}
    return {**own, "n_ctx": own.get("n_positions"), "n_inner": config.get("intermediate_size"),
            "activation_function": "gelu_new", **config}


def gpt2_fields(config: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """GPT-2's ``ModelArgs`` fields (the family reader, ``families.FAMILIES``)."""
    activation = config.get("activation_function") or config.get("hidden_act") or "gelu_new"
    if activation not in _ACTIVATIONS:
        raise MlxformerError(f"unsupported activation {activation!r} for gpt2 (only the tanh GELU, gelu_new)")
    if config.get("scale_attn_by_inverse_layer_idx"):
        raise MlxformerError("unsupported config setting scale_attn_by_inverse_layer_idx=true for gpt2")
    return {
        "num_key_value_heads": base["num_attention_heads"], "rms_norm_eps": float(config.get("rms_norm_eps", 1e-5)),
        "norm_type": "layer", "position_type": "learned", "gated_mlp": False, "hidden_act": "gelu_tanh",
        "fused_qkv": True, "qkv_bias": True, "o_proj_bias": True, "mlp_bias": True,
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", True)),
        "attention_scale": None if config.get("scale_attn_weights", True) else 1.0,
    }
