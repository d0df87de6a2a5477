"""A model's own sampling defaults, and the one rule that applies them.

The rule, shared by the CLI (``generate``, ``chat``) and the server (every API): a sampling field
the request (or a flag) sets wins; else the model's default; else ``SamplingSettings``'s own
(greedy, no filters). The model's defaults come from:

- an HF/MLX dir's ``generation_config.json``: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
  ``repetition_penalty``. As in transformers, ``temperature`` counts only with
  ``"do_sample": true`` (without it transformers decodes greedily); the others count as given.
- a GGUF's ``general.sampling.*`` metadata (what llama.cpp's converter writes from that file):
  ``temp``, ``top_p``, ``top_k``, ``min_p``, ``penalty_repeat``.

A value out of range (e.g. ``top_p: 0``) is dropped rather than failing the load: the field
then falls back to ``SamplingSettings``'s default.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from mlxformer.errors import OptionError
from mlxformer.formats.jsonio import read_json_object
from mlxformer.sampling.options import SamplingSettings

# generation_config.json key -> SamplingSettings field
HF_KEYS = {"temperature": "temp", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty"}
# GGUF metadata key -> SamplingSettings field
GGUF_KEYS = {"general.sampling.temp": "temp", "general.sampling.top_p": "top_p", "general.sampling.top_k": "top_k",
             "general.sampling.min_p": "min_p", "general.sampling.penalty_repeat": "repetition_penalty"}


@dataclass(frozen=True)
class SamplingDefaults:
    """The sampling fields a model's files set (``None``: not set)."""

    temp: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    @classmethod
    def from_generation_config(cls, config: Mapping[str, Any]) -> SamplingDefaults:
        """The defaults in a ``generation_config.json`` object (see the module docstring)."""
        values = {field: config.get(key) for key, field in HF_KEYS.items()}
        if config.get("do_sample") is not True:
            values["temp"] = None
        return cls._checked(values)

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> SamplingDefaults:
        """The defaults in GGUF metadata's ``general.sampling.*`` keys."""
        return cls._checked({field: metadata.get(key) for key, field in GGUF_KEYS.items()})

    @classmethod
    def of_checkpoint(cls, directory: Path | None, gguf_metadata: Mapping[str, Any] | None) -> SamplingDefaults:
        """The defaults of a checkpoint: its GGUF metadata's, else its dir's generation_config.json."""
        if gguf_metadata is not None:
            return cls.from_gguf(gguf_metadata)
        path = directory / "generation_config.json" if directory is not None else None
        return cls.from_generation_config(read_json_object(path)) if path is not None and path.is_file() else NO_DEFAULTS

    @classmethod
    def _checked(cls, values: dict[str, Any]) -> SamplingDefaults:
        kept: dict[str, Any] = {}
        for name, value in values.items():
            if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            value = int(value) if name == "top_k" else float(value)
            if name == "top_k" and value < 0:
                continue
            try:
                SamplingSettings(**{name: value})
            except OptionError:
                continue
            kept[name] = value
        return cls(**kept)

    def as_dict(self) -> dict[str, float | int]:
        """The fields that are set, by ``SamplingSettings`` name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def describe(self) -> str:
        """One line for ``info`` and logs, e.g. ``temp 0.7, top_p 0.8`` (``none`` when unset)."""
        return ", ".join(f"{name} {value:g}" for name, value in self.as_dict().items()) or "none"

    def apply(self, **given: Any) -> SamplingSettings:
        """``SamplingSettings`` from the ``given`` fields, each ``None`` one taken from these
        defaults, else from ``SamplingSettings``'s own. Raises ``OptionError`` for a bad value."""
        chosen = {name: value for name, value in given.items() if value is not None}
        return SamplingSettings(**{**self.as_dict(), **chosen})

    def generation_config(self) -> dict[str, Any]:
        """These defaults as ``generation_config.json`` entries (what ``from_generation_config`` reads back)."""
        names = {field: key for key, field in HF_KEYS.items()}
        entries: dict[str, Any] = {names[name]: value for name, value in self.as_dict().items()}
        if self.temp is not None:
            entries["do_sample"] = True
        return entries


NO_DEFAULTS = SamplingDefaults()
