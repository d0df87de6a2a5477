"""Models as ``convert`` writes them for mlx-lm: Gated DeltaNet models (Qwen3.5, Qwen3.5-MoE,
Qwen3-Next) in the layout and under the names mlx-lm's own ``qwen3_5``, ``qwen3_5_moe`` and
``qwen3_next`` models load, as its conversions (mlx-community's dirs) store them; GPT-2 under
mlx-lm's ``gpt2`` names (``model.h.N.attn.c_attn``, Linear layout) with its config keys.

- Tensors: the conv1d weight ``(C, K, 1)`` (HF: ``(C, 1, K)``) and the ``(1 + w)`` RMSNorms
  with the 1 folded in. mlx-lm's ``qwen3_next`` reads nothing else (its ``sanitize`` only fixes
  HF dirs with per-expert tensors); the checkpoint reader recognises the layout by the conv's
  shape (``with_stored_layout``), so the output reads back too.
- Config: flat (mlx-lm takes a config without ``text_config`` as the text model's), with
  mlx-lm's model types (``qwen3_5``/``qwen3_5_moe``: transformers' image-text types, which the
  reader maps to the text ones), ``rope_parameters`` (mlx-lm's Qwen3.5 reads theta and the rotated
  share only there, else its defaults) and ``full_attention_interval`` (mlx-lm places the
  attention layers by it, not by ``layer_types``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from mlxformer.formats.gguf_hybrid import SHIFTED_NORMS
from mlxformer.formats.tensors import Derivation, Tensors
from mlxformer.models.config import ModelArgs
from mlxformer.models.families import MLX_LM_LAYOUT
from mlxformer.formats.gpt2_names import mlx_lm_gpt2_names
from mlxformer.models.gpt2_family import mlx_lm_gpt2_config

MLX_LM_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe", "qwen3_next": "qwen3_next"}


def stored_for_mlx_lm(args: ModelArgs, weights: Tensors) -> tuple[ModelArgs, Tensors]:
    """A hybrid model's weights in mlx-lm's layout, with the args that read them (any other
    model's, or weights already in that layout, as they are)."""
    if not args.linear_num_value_heads or args.linear_conv_channels_last:
        return args, weights
    derivations = {}
    for name, entry in weights.entries.items():
        if name.endswith("linear_attn.conv1d.weight"):
            channels, _, kernel = entry.shape  # (C, 1, K) -> (C, K, 1)
            derivations[name] = Derivation((name,), (channels, kernel, 1), entry.dtype, lambda p: p[0].swapaxes(1, 2))
        elif name.endswith(SHIFTED_NORMS) and len(entry.shape) == 1:
            derivations[name] = Derivation((name,), entry.shape, entry.dtype, lambda p: p[0] + 1)
    stored = dataclasses.replace(args, norm_offset=0.0, linear_conv_channels_last=True)
    return stored, weights.derived(derivations)


def with_stored_layout(config: dict[str, Any], entries: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` marked with ``MLX_LM_LAYOUT`` when the tensors (name -> entry with ``shape``)
    are in mlx-lm's Gated DeltaNet layout: a conv1d weight whose last axis is 1 (HF: the kernel)."""
    for name, entry in entries.items():
        if name.endswith("linear_attn.conv1d.weight"):
            shape = tuple(entry.shape)
            return {**config, MLX_LM_LAYOUT: True} if shape[-1] == 1 and shape[1] > 1 else config
    return config


def mlx_lm_names(args: ModelArgs, names: Any) -> dict[str, str]:
    """The renames (decoder -> mlx-lm) of the output's weight names, or of the module paths of
    its ``quantization`` entry (GPT-2's; none for every other model)."""
    return mlx_lm_gpt2_names(names) if args.model_type == "gpt2" else {}


def mlx_lm_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (flat, as ``convert`` merges it) with mlx-lm's keys for a hybrid model or
    GPT-2 (any other model's as it is)."""
    model_type = config.get("model_type")
    if model_type == "gpt2":
        return mlx_lm_gpt2_config(config)
    if model_type not in MLX_LM_TYPES:
        return config
    out = {**config, "model_type": MLX_LM_TYPES[model_type]}
    out.setdefault("rope_parameters", {"type": "default", "rope_theta": config["rope_theta"],
                                       "partial_rotary_factor": config.get("partial_rotary_factor", 1.0)})
    kinds = config.get("layer_types") or []
    interval = kinds.index("full_attention") + 1 if "full_attention" in kinds else 0
    if interval and kinds == ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                              for i in range(len(kinds))]:
        out["full_attention_interval"] = interval
    return out
