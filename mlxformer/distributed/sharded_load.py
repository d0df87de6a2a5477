"""Each rank reads only the tensors (or the slices of them) it holds.

Safetensors (HF or MLX, quantized too) are opened lazily by ``mx.load``: a tensor is read
when evaluated, and each one is evaluated (and copied out of the full tensor when only a
slice is kept) before the next, so a rank's peak memory is its share plus at most one full
tensor. GGUF files are memory-mapped and only the chosen tensors are decoded (``load_gguf``
with ``wanted``/``piece``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from mlxformer.errors import MlxformerError
from mlxformer.formats.gguf import load_gguf
from mlxformer.formats.hub import resolve_source
from mlxformer.formats.safetensors import read_config, read_safetensors_header, safetensors_files
from mlxformer.models.config import ModelArgs
from mlxformer.tokenizer import Tokenizer, load_tokenizer_from_dir, load_tokenizer_from_gguf

# ``piece(name, full_array)``: the part of a tensor this rank keeps (``None`` keeps all of it).
Piece = Callable[[str, mx.array], mx.array]


@dataclass
class CheckpointReader:
    """A checkpoint opened for reading chosen tensors: its config and where each tensor is."""

    source: Path
    config: dict[str, Any]
    files: dict[str, Path]  # HF tensor name -> safetensors file (empty for GGUF)
    gguf_metadata: dict[str, Any] | None = None

    @property
    def args(self) -> ModelArgs:
        return ModelArgs.from_dict(self.config)

    def read(self, wanted: Callable[[str], bool], piece: Piece | None = None) -> dict[str, mx.array]:
        """The HF-named tensors for which ``wanted(name)`` holds, cut by ``piece``, evaluated
        one at a time."""
        out: dict[str, mx.array] = {}

        def keep(name: str, array: mx.array) -> None:
            if piece is not None:
                array = mx.contiguous(piece(name, array))  # a copy: the full tensor is freed
            mx.eval(array)
            out[name] = array

        if self.gguf_metadata is not None:
            return load_gguf(self.source, wanted, piece)[1]
        for file in sorted(set(self.files.values())):
            names = [n for n, f in self.files.items() if f == file and wanted(n)]
            if not names:
                continue
            try:
                lazy = mx.load(str(file))
            except (RuntimeError, ValueError) as exc:
                raise MlxformerError(f"{file}: cannot read safetensors ({exc})") from None
            for name in names:
                keep(name, lazy.pop(name))
            del lazy
        return out

    def tokenizer(self) -> Tokenizer:
        """The checkpoint's tokenizer."""
        if self.gguf_metadata is not None:
            return load_tokenizer_from_gguf(self.gguf_metadata)
        return load_tokenizer_from_dir(self.source)


def open_checkpoint(path_or_repo: str | Path) -> CheckpointReader:
    """Read the config and the tensor headers (not the weights) of a dir, repo id or ``.gguf``."""
    source = resolve_source(path_or_repo)
    if source.is_file():
        if source.suffix.lower() != ".gguf":
            raise MlxformerError(f"{source}: not a model dir or .gguf file")
        config, _, metadata = load_gguf(source, wanted=lambda name: False)  # checks every tensor, decodes none
        reader = CheckpointReader(source, config, {}, metadata)
    else:
        files = {}
        for file in safetensors_files(source):
            files.update({name: file for name in read_safetensors_header(file)})
        reader = CheckpointReader(source, read_config(source), files)
    reader.args  # fail on an unsupported model before reading any weight
    return reader


def skipped(name: str, args: ModelArgs) -> bool:
    """Checkpoint tensors the decoder never uses (rotary tables; a tied output projection)."""
    return "rotary_emb.inv_freq" in name or (args.tie_word_embeddings and name.startswith("lm_head."))
