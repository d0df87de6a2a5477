"""Checkpoint formats behind one reader: ``formats.open_checkpoint(path)`` (``checkpoint.py``)
opens HF/MLX dirs, hub repos and GGUF files alike, for load, convert, ``info`` and distributed
loading.

- The reader: ``checkpoint.py`` (``open_checkpoint``, ``Checkpoint``), ``tensors.py`` (the lazy
  name to array mapping), ``safetensors.py`` (safetensors files and model dirs, checked),
  ``jsonio.py`` (JSON from model dirs).
- GGUF: ``gguf.py`` (a GGUF as a checkpoint), ``gguf_reader.py`` (the strict container
  parser), ``gguf_split.py`` (split files as one), ``gguf_quants.py`` (block decoders),
  ``gguf_names.py`` (the GGUF to HF name table), ``gguf_families.py`` (each architecture's
  config keys), ``gguf_rope.py`` (``rope_freqs`` as ``rope_scaling``), ``gguf_hybrid.py``
  (Gated DeltaNet GGUFs back in HF's layout), ``gguf_vocab.py`` (the tokenizer from metadata).
- Names and layouts: ``weight_map.py`` (``decoder_weights``: every rename and derivation into
  the decoder's names), ``gpt2_names.py`` (GPT-2's names, ``Conv1D`` transposed),
  ``expert_layouts.py`` (per-expert and fused experts stacked), ``gpt_oss.py`` (gpt-oss's fused
  and MXFP4 experts), ``mla_layout.py`` (the split ``kv_b_proj`` joined).
- The hub: ``hub.py`` (a path or ``REPO[:QUANT]``), ``hub_gguf.py`` (which GGUF a ``:QUANT``
  names), ``hub_cache.py`` (the HF cache for ``list``/``rm``).
- Writing: ``mlx_writer.py`` (sharded, staged MLX dirs for ``convert``), ``mlx_lm_layout.py``
  (the layouts and names mlx-lm loads)."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # Lazy, so that importing one small submodule (``jsonio``, ``gguf_vocab``) imports no MLX.
    if name in ("open_checkpoint", "Checkpoint"):
        from mlxformer.formats import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(name)
