"""mlx-lm's (and llama.cpp's) split ``kv_b_proj`` of multi-head latent attention joined back
into HF's, which the decoder's ``models.mla`` holds."""

from __future__ import annotations

import re
from typing import Mapping, Protocol

import mlx.core as mx

from mlxformer.formats.tensors import Derivation
from mlxformer.models.config import ModelArgs


class Shaped(Protocol):
    shape: tuple[int, ...]
    dtype: mx.Dtype


_EMBED_Q = re.compile(r"^(.*\.self_attn)\.embed_q\.weight$")


def _dense(arrays: list[mx.array], in_dims: int) -> mx.array:
    """A part's float weight: dequantized in float32 when stored with scales (and biases): a
    code times a float16 scale needs more bits than float16 has (GGUF's Q8_0)."""
    if len(arrays) == 1:
        return arrays[0]
    weight, scales, *biases = arrays
    return mx.dequantize(weight, scales.astype(mx.float32), *(b.astype(mx.float32) for b in biases),
                         group_size=in_dims // scales.shape[-1], bits=weight.shape[-1] * 32 // in_dims)



def absorbed_kv_b(entries: Mapping[str, Shaped], args: ModelArgs) -> dict[str, Derivation]:
    """mlx-lm stores ``kv_b_proj`` split per head: ``embed_q`` ``(H, rank, nope)`` (its key part,
    transposed) and ``unembed_out`` ``(H, v, rank)``, each maybe quantized (bits and group size
    read off the shapes); llama.cpp's ``attn_k_b``/``attn_v_b`` are the same (``gguf_names``).
    Returns, per layer, the ``kv_b_proj.weight`` they make back (for ``Tensors.derived``)."""
    H, rank, nope, v = args.num_attention_heads, args.kv_lora_rank, args.qk_nope_head_dim, args.v_head_dim
    derivations: dict[str, Derivation] = {}
    for name in entries:
        match = _EMBED_Q.match(name)
        if match is None:
            continue
        prefix = match.group(1)
        parts = {part: [f"{prefix}.{part}.{kind}" for kind in ("weight", "scales", "biases")
                        if f"{prefix}.{part}.{kind}" in entries] for part in ("embed_q", "unembed_out")}
        members = parts["embed_q"] + parts["unembed_out"]
        split = len(parts["embed_q"])

        def join(arrays: list[mx.array], split: int = split) -> mx.array:
            wk, wv = _dense(arrays[:split], nope), _dense(arrays[split:], rank)
            # (H, rank, nope) -> (H, nope, rank); with (H, v, rank) -> (H * (nope + v), rank)
            return mx.concatenate([wk.swapaxes(-1, -2), wv], axis=1).reshape(H * (nope + v), rank)

        dtype = mx.float32 if split > 1 else entries[name].dtype
        derivations[f"{prefix}.kv_b_proj.weight"] = Derivation(tuple(members), (H * (nope + v), rank), dtype, join)
    return derivations
