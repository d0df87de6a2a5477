"""A checkpoint's tensors under the decoder's names: every rename and derivation, in one place.

``decoder_weights(args, weights)`` is the one path from what a checkpoint stores (HF, mlx-lm
or GGUF names, after ``gguf_names``) to what ``models.decoder.Model`` holds, for lazy
``Tensors`` and for a dict of arrays alike (a dict becomes ``Tensors.of_arrays``), in order:

1. GPT-2's ``Conv1D`` weights transposed and renamed (``gpt2_names``);
2. renames: an image-text checkpoint's language model, a base model's unprefixed names, GPT-2's;
3. with experts: HF's per-expert matrices stacked, gpt-oss's fused (and MXFP4) experts and
   Gemma 4's fused ones split (``expert_layouts``, ``gpt_oss``);
4. with latent attention: mlx-lm's split ``kv_b_proj`` joined (``mla_layout``);
5. the keys the decoder has no parameter for dropped (``unused_weight``).

Nothing is read: each step maps header entries, and a derived tensor reads its sources when
it is accessed. ``decoder_quantization`` gives the config's ``quantization`` entry under the
same names.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import mlx.core as mx

from mlxformer.formats.expert_layouts import expert_groups, gemma4_expert_derivations
from mlxformer.formats.gpt2_names import conv1d_derivations, gpt2_weight_names, is_gpt2_buffer
from mlxformer.formats.gpt_oss import MXFP4, fused_expert_derivations
from mlxformer.formats.mla_layout import absorbed_kv_b
from mlxformer.formats.tensors import Tensors
from mlxformer.models.config import ModelArgs

# An image-text checkpoint's language model weights (HF: ``model.language_model.``; mlx-lm's
# wrapper: ``language_model.``) -> the decoder's names; its vision tower is dropped (``_NOT_TEXT``).
# A base model's (``Qwen3Model``, ``Gemma3TextModel``: an embedding model's) have no ``model.``.
_TEXT_WEIGHT_PREFIXES = (("model.language_model.", "model."), ("language_model.", ""),
                         ("embed_tokens.", "model.embed_tokens."), ("layers.", "model.layers."), ("norm.", "model.norm."))
# An image-text checkpoint's vision tower and a multi-token-prediction head: not the decoder's.
_NOT_TEXT = ("model.visual.", "visual.", "vision_tower.", "mtp.", "model.vision_tower.", "model.audio_tower.",
             "model.embed_vision.", "model.embed_audio.")


def decoder_weights(args: ModelArgs, weights: Mapping[str, mx.array]) -> Tensors:
    """``weights`` (a checkpoint's ``Tensors`` or a dict of arrays, under its names) as the
    tensors the decoder of ``args`` uses, under its names, still lazy (module docstring)."""
    tensors = weights if isinstance(weights, Tensors) else Tensors.of_arrays(weights)
    tensors = tensors.derived(conv1d_derivations(tensors.entries))  # GPT-2's Conv1D weights, transposed and renamed
    tensors = tensors.renamed(text_weight_names(tensors.entries))  # an image-text checkpoint's language model, GPT-2's
    if args.num_experts:  # HF's per-expert matrices -> stacked (experts, out, in), still lazy
        tensors = tensors.stacked(expert_groups(tensors.entries, args.num_experts))
        tensors = tensors.derived(fused_expert_derivations(tensors.entries))  # gpt-oss
        tensors = tensors.derived(gemma4_expert_derivations(tensors.entries))  # Gemma 4
    if args.attention_type == "mla":  # mlx-lm's split kv_b_proj -> HF's, still lazy
        tensors = tensors.derived(absorbed_kv_b(tensors.entries, args))
    unused = unused_weight(args)
    return tensors.subset(name for name in tensors.entries if not unused(name))


def text_weight_names(names: Iterable[str]) -> dict[str, str]:
    """The renames (old -> new) that take an image-text checkpoint's language model weights, a
    base model's or GPT-2's (``gpt2_names``: its ``Conv1D`` weights are also transposed) to the
    decoder's names (none for a checkpoint already named as the decoder is). Also renames the
    module paths of a ``quantization`` entry."""
    names = list(names)
    renames = gpt2_weight_names(names)
    for name in names:
        for prefix, replacement in _TEXT_WEIGHT_PREFIXES:
            if name.startswith(prefix):
                renames[name] = replacement + name[len(prefix):]
                break
    return renames


def unused_weight(args: ModelArgs) -> Callable[[str], bool]:
    """Whether a checkpoint key (under the decoder's names) carries no weight of the decoder of
    ``args``: rotary tables, another tower, GPT-2's mask buffers, the multi-token-prediction
    layers after the decoder's (GLM, DeepSeek), the k/v projections Gemma 4's KV-shared layers
    never use, and a tied output projection."""
    dropped = _NOT_TEXT
    first = args.num_hidden_layers  # GLM/DeepSeek's multi-token-prediction layers follow the decoder's
    dropped += tuple(f"model.layers.{i}." for i in range(first, first + args.mtp_layers))
    if args.num_kv_shared_layers:  # checkpoints keep k/v projections the shared layers never use
        shared = range(args.num_hidden_layers - args.num_kv_shared_layers, args.num_hidden_layers)
        dropped += tuple(f"model.layers.{i}.self_attn.{name}." for i in shared
                         for name in ("k_proj", "v_proj", "k_norm", "v_norm"))
    tied = ("lm_head.weight", "lm_head.scales", "lm_head.biases") if args.tie_word_embeddings else ()

    def unused(name: str) -> bool:
        return "rotary_emb.inv_freq" in name or name.startswith(dropped) or is_gpt2_buffer(name) or name in tied

    return unused


def quantization_of(config: dict[str, Any]) -> dict[str, Any] | None:
    """The mlx-lm ``quantization`` entry of a config (``quantization_config`` as fallback), as
    the checkpoint reader checked it (``checkpoint._check_quantization``)."""
    quantization = config.get("quantization") or config.get("quantization_config")
    if quantization and quantization.get("quant_method") == "mxfp4":  # HF's gpt-oss: the experts' blocks
        return dict(MXFP4)
    return quantization or None


def decoder_quantization(config: dict[str, Any]) -> dict[str, Any] | None:
    """``quantization_of(config)`` with its per-layer entries under the decoder's names (an
    image-text checkpoint's renamed, as ``decoder_weights`` renames its tensors)."""
    quantization = quantization_of(config)
    if not quantization:
        return None
    renames = text_weight_names(quantization)
    return {renames.get(key, key): value for key, value in quantization.items()}
