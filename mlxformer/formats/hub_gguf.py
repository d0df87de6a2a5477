"""Which GGUF of a hub repo ``REPO[:QUANT]`` names, from the repo's file list alone.

A repo's ``.gguf`` files group into models: one file, or the parts of a split GGUF
(``NAME-0000i-of-0000N.gguf``, ``gguf_split``). A model's quant tag is the last piece of its
path (split at ``-``, ``.``, ``/``) that reads like llama.cpp's type names (``Q4_K_M``,
``IQ4_XS``, ``Q8_0``, ``F16``, ``BF16``, ...), upper-cased. As llama.cpp's ``-hf REPO:QUANT``
does, the tag is matched case-insensitively; without a tag, ``DEFAULT_QUANTS`` in order, then
the largest model that fits in ``memory`` bytes, then the smallest. Multimodal projectors
(``mmproj*``) and llama.cpp's sidecars (``mtp-*``, ``eagle3-*``, ``dflash-*``, ``dspark-*``,
``imatrix``) are not models. No match, or several models with the tag, is a one-line error
listing what there is. ``pick_sidecar`` finds a model's ``mtp-*`` file as llama.cpp's
``-hf REPO:QUANT --mtp`` does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from mlxformer.errors import MlxformerError
from mlxformer.formats.gguf_split import SPLIT_NAME, split_part_names

DEFAULT_QUANTS = ("Q4_K_M",)
QUANT_PIECE = re.compile(r"^(I?Q\d(_[A-Z0-9]+)*|TQ\d_\d|MXFP4(_MOE)?|B?F16|F32|FP16)$", re.IGNORECASE)
REF_PREFIXES = ("hf.co/", "huggingface.co/", "https://huggingface.co/")
# File names that are not models (llama.cpp's ``gguf_filename_is_model``), by prefix or part.
SIDECAR_PREFIXES = ("mmproj", "mtp-", "eagle3-", "dflash-", "dspark-")


@dataclass(frozen=True)
class GGUFModel:
    """One loadable GGUF of a repo: its file (or its split parts, in order), tag and bytes."""

    files: tuple[str, ...]
    quant: str | None
    size: int

    @property
    def name(self) -> str:
        """Its first file: what ``load`` opens."""
        return self.files[0]


def split_ref(ref: str) -> tuple[str, str | None]:
    """``(repo id, quant tag or None)`` of ``REPO[:QUANT]`` (Ollama's ``hf.co/REPO:QUANT`` too)."""
    for prefix in REF_PREFIXES:
        if ref.startswith(prefix):
            ref = ref[len(prefix):]
    repo, colon, tag = ref.partition(":")
    return repo, (tag.strip() or None) if colon else None


def quant_of(path: str) -> str | None:
    """The quant tag of a GGUF path (see the module docstring), or None."""
    stem = path[: -len(".gguf")] if path.lower().endswith(".gguf") else path
    match = SPLIT_NAME.match(path.rsplit("/", 1)[-1])
    if match is not None:
        stem = path[: len(path) - len(path.rsplit("/", 1)[-1])] + match["stem"]
    pieces = [p for p in re.split(r"[-./]", stem) if QUANT_PIECE.match(p)]
    return pieces[-1].upper() if pieces else None


def gguf_models(files: Mapping[str, int]) -> list[GGUFModel]:
    """The GGUF models among a repo's ``{path: bytes}``: single files and complete split sets
    (a part whose siblings are not all listed is left out), sorted by path."""
    models = []
    for path in sorted(files):
        name = path.rsplit("/", 1)[-1]
        if not name.lower().endswith(".gguf") or name.lower().startswith(SIDECAR_PREFIXES) or "imatrix" in name.lower():
            continue
        parts = split_part_names(name)
        if parts is None:
            models.append(GGUFModel((path,), quant_of(path), files[path]))
            continue
        folder = path[: len(path) - len(name)]
        paths = tuple(folder + part for part in parts)
        if path == paths[0] and all(p in files for p in paths):
            models.append(GGUFModel(paths, quant_of(path), sum(files[p] for p in paths)))
    return models


def _listing(models: list[GGUFModel]) -> str:
    return ", ".join(f"{m.quant or '?'} ({m.name})" for m in models)


def pick_gguf(repo: str, models: list[GGUFModel], tag: str | None, memory: int | None = None) -> GGUFModel:
    """The model ``repo:tag`` names (see the module docstring); ``memory``: the bytes a model may take."""
    if not models:
        raise MlxformerError(f"{repo} has no GGUF model" + (f" (asked for {tag!r})" if tag else ""))
    if tag is not None:
        chosen = [m for m in models if m.quant == tag.upper() or m.name == tag]
        if not chosen:
            raise MlxformerError(f"{repo} has no GGUF with quant tag {tag!r}; it has: {_listing(models)}")
        if len(chosen) > 1:
            raise MlxformerError(f"{repo}:{tag} is ambiguous, it matches {len(chosen)} GGUFs: {_listing(chosen)}; "
                                 f"name one by its file, {repo}:FILE")
        return chosen[0]
    if len(models) == 1:
        return models[0]
    for default in DEFAULT_QUANTS:
        chosen = [m for m in models if m.quant == default]
        if len(chosen) == 1:
            return chosen[0]
    fitting = [m for m in models if memory is None or m.size <= memory]
    return max(fitting, key=lambda m: m.size) if fitting else min(models, key=lambda m: m.size)


def _bits(quant: str | None) -> int:
    """The first number of a quant tag (``Q4_K_M``: 4, ``BF16``: 16), 0 without one."""
    match = re.search(r"\d+", quant or "")
    return int(match.group()) if match else 0


def pick_sidecar(files: Mapping[str, int], model: str, tag: str | None, prefix: str = "mtp-") -> str | None:
    """The repo's ``{prefix}*.gguf`` file for GGUF ``model``, as llama.cpp's ``find_best_sibling``
    picks it: in the model's folder or one above it, the deepest folder shared with the model
    first, then one with the tag in its name, then the nearest quant bits; None when there is none."""
    folder = model.rsplit("/", 1)[0].split("/") if "/" in model else []
    wanted = _bits(tag) if tag else _bits(quant_of(model))
    best: tuple[int, bool, int] | None = None
    chosen = None
    for path in sorted(files):
        *parts, name = path.split("/")
        if not (name.lower().startswith(prefix) and name.lower().endswith(".gguf")) or parts != folder[:len(parts)]:
            continue
        exact = tag is not None and f"-{tag.upper()}." in path.upper()
        rank = (len(parts), exact, -abs(_bits(quant_of(path)) - wanted))
        if best is None or rank > best:
            best, chosen = rank, path
    return chosen
