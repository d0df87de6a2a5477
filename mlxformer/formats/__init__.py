"""Checkpoint formats behind one reader: ``formats.open_checkpoint(path)`` (see
``formats/checkpoint.py``) opens HF/MLX dirs, hub repos and GGUF files alike."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # Lazy, so that importing one small submodule (``jsonio``, ``gguf_vocab``) imports no MLX.
    if name in ("open_checkpoint", "Checkpoint"):
        from mlxformer.formats import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(name)
