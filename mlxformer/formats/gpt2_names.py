"""GPT-2's checkpoint names as the decoder's (``models.gpt2_family`` reads its config).

Its checkpoints name the weights ``transformer.h.N.attn.c_attn`` (the hub's ``gpt2``: no
prefix) and store each projection as a ``Conv1D``, ``(in, out)``: ``conv1d_derivations``
transposes them where ``gpt2_weight_names`` renames them. mlx-lm stores GPT-2 as
``model.h.N.attn.c_attn`` in Linear layout; ``convert`` writes that (``mlx_lm_gpt2_names``)
and the reader reads it.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

import mlx.core as mx

from mlxformer.errors import MlxformerError
from mlxformer.formats.tensors import Derivation

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
