"""mlxformer: an MLX runtime for LLaMA-family decoder LLMs.

Public API: ``load``, ``generate``, ``stream_generate``, ``convert``, ``embed`` and ``rerank``. They are imported on
first use, so that ``import mlxformer.cli`` (and ``mlxformer --help``) stays light.

The root holds ``loader.py`` (``load``: checkpoint to checked weights to the decoder, with the
tokenizer), ``default_model.py`` (the offline default model), ``device.py`` (where MLX runs),
``errors.py`` (``MlxformerError``, ``OptionError``) and ``__main__.py``; every other module lives
in a package named for its job, each described in its ``__init__.py``: ``models/`` (the one
decoder), ``cache/`` (KV caches), ``formats/`` (checkpoints), ``text/``, ``sampling/``,
``generation/``, ``speculative/``, ``constrained/`` (structured output), ``adapters/``,
``embeddings/``, ``quant/``, ``tools/`` (convert, perplexity, bench, ``info``), ``engine/``
(continuous batching), ``server/``, ``distributed/`` and ``cli/``."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxformer.tools.converter import convert
    from mlxformer.embeddings.encode import embed
    from mlxformer.embeddings.rerank import rerank
    from mlxformer.errors import MlxformerError, OptionError
    from mlxformer.generation.stream import GenerationResponse, generate, stream_generate
    from mlxformer.sampling.options import SamplingSettings
    from mlxformer.loader import load

# public name -> the module that defines it
_EXPORTS = {
    "load": "mlxformer.loader",
    "generate": "mlxformer.generation.stream",
    "stream_generate": "mlxformer.generation.stream",
    "GenerationResponse": "mlxformer.generation.stream",
    "SamplingSettings": "mlxformer.sampling.options",
    "convert": "mlxformer.tools.converter",
    "embed": "mlxformer.embeddings.encode",
    "rerank": "mlxformer.embeddings.rerank",
    "MlxformerError": "mlxformer.errors",
    "OptionError": "mlxformer.errors",
}

__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mlxformer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
