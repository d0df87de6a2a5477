"""GPT-2 (``gpt2``) as fields of the one decoder, and its checkpoint names as the decoder's.

GPT-2 is the decoder with learned absolute positions (``position_type="learned"``: ``wpe``),
LayerNorms with a bias, a plain (ungated) GELU-tanh MLP, one fused ``c_attn`` projection,
biases on every projection and a tied output. Its config names the sizes ``n_embd``,
``n_layer``, ``n_head``, ``n_positions``, ``n_inner``; its checkpoints name the weights
``transformer.h.N.attn.c_attn`` and store each projection as a ``Conv1D``, ``(in, out)``:
the reader transposes them (``conv1d_derivations``) where it renames them (``gpt2_weight_names``).
mlx-lm stores GPT-2 as ``model.h.N.attn.c_attn`` in Linear layout; ``convert`` writes that
(``mlx_lm_gpt2_names``) and the reader reads it.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

import mlx.core as mx

from mlxformer.errors import MlxformerError
from mlxformer.formats.tensors import Derivation

# GPT-2's config keys -> the shared ones (a key already present wins: a config written back)
_CONFIG_KEYS = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
                "n_positions": "max_position_embeddings", "layer_norm_epsilon": "rms_norm_eps"}
_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu_tanh")  # transformers' tanh-approximated GELUs

# A GPT-2 weight or module name -> (prefix, layer or None, module, suffix or ""): the hub's
# ``transformer.`` (or none, the hub's ``gpt2``), or mlx-lm's ``model.`` (its layout: Linear, not Conv1D).
_NAME = re.compile(r"^(transformer\.|model\.)?(?:h\.(\d+)\.)?([a-z_0-9.]+?)(?:\.(weight|bias|scales|biases))?$")
_TOP = {"wte": "model.embed_tokens", "wpe": "model.embed_positions", "ln_f": "model.norm"}
_LAYER = {"ln_1": "input_layernorm", "attn.c_attn": "self_attn.qkv_proj", "attn.c_proj": "self_attn.o_proj",
          "ln_2": "post_attention_layernorm", "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}
_DECODER = re.compile(r"^model\.(?:layers\.(\d+)\.)?([a-z_0-9.]+?)(?:\.(weight|bias|scales|biases))?$")
_TOP_BACK = {v.removeprefix("model."): k for k, v in _TOP.items()}
_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_BUFFER = re.compile(r"^(?:transformer\.)?h\.\d+\.attn\.(?:masked_)?bias$")
# The layers GPT-2 stores as ``Conv1D`` (weight ``(in, out)``, the transpose of ``nn.Linear``'s)
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


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


def _decoder_name(name: str) -> str | None:
    """The decoder's name of GPT-2 weight (or module) ``name`` (None: not a GPT-2 name)."""
    match = _NAME.match(name)
    if match is None:
        return None
    _, layer, module, suffix = match.groups()
    table = _TOP if layer is None else _LAYER
    if module not in table:
        return None
    new = table[module] if layer is None else f"model.layers.{layer}.{table[module]}"
    return f"{new}.{suffix}" if suffix else new


def gpt2_weight_names(names: Iterable[str]) -> dict[str, str]:
    """The renames (old -> new) of a GPT-2 checkpoint's weights (or its quantization entries'
    module paths) to the decoder's names: the hub's and mlx-lm's (none for other checkpoints:
    no other family names a tensor ``h.N.attn.c_attn``, ``wte``...)."""
    renames = {}
    for name in names:
        new = _decoder_name(name)
        if new is not None:
            renames[name] = new
    return renames


def mlx_lm_gpt2_names(names: Iterable[str]) -> dict[str, str]:
    """The decoder's GPT-2 weight (or module) names -> mlx-lm's (``model.h.N.attn.c_attn.weight``,
    Linear layout), which ``gpt2_weight_names`` reads back."""
    renames = {}
    for name in names:
        match = _DECODER.match(name)
        if match is None:
            continue
        layer, module, suffix = match.groups()
        table = _TOP_BACK if layer is None else _LAYER_BACK
        if module in table:
            old = f"model.{table[module]}" if layer is None else f"model.h.{layer}.{table[module]}"
            renames[name] = f"{old}.{suffix}" if suffix else old
    return renames


def conv1d_derivations(entries: Mapping[str, Any]) -> dict[str, Derivation]:
    """GPT-2's ``Conv1D`` weights ``(in, out)`` (name -> entry with ``shape``/``dtype``) as the
    decoder's ``nn.Linear`` weights ``(out, in)``, under the decoder's names."""
    out: dict[str, Derivation] = {}
    for name, entry in entries.items():
        match = _NAME.match(name)  # the hub's layout only: mlx-lm's (``model.``) is already Linear's
        if match is None or match.group(1) == "model." or match.group(2) is None or match.group(3) not in _CONV1D \
                or match.group(4) != "weight":
            continue
        shape = tuple(entry.shape)
        if len(shape) != 2:
            raise MlxformerError(f"{name}: a GPT-2 Conv1D weight must be (in, out), not {list(shape)}")
        out[str(_decoder_name(name))] = Derivation((name,), shape[::-1], entry.dtype, lambda a: mx.contiguous(a[0].T))
    return out


def is_gpt2_buffer(name: str) -> bool:
    """Whether ``name`` is one of the causal-mask buffers old GPT-2 checkpoints saved (no weight)."""
    return _BUFFER.match(name) is not None
