"""mlxformer: an MLX runtime for LLaMA-family decoder LLMs.

Public API: ``load``, ``generate``, ``stream_generate`` (and ``convert`` for conversion).
"""

from .errors import MlxformerError
from .generate import GenerationResponse, SamplingSettings, generate, stream_generate
from .loader import load

__all__ = ["load", "generate", "stream_generate", "convert", "GenerationResponse", "SamplingSettings", "MlxformerError"]
__version__ = "0.1.0"


def convert(*args, **kwargs):  # type: ignore[no-untyped-def]
    """Convert a model to MLX format (see ``mlxformer.convert.convert``)."""
    from .convert import convert as _convert

    return _convert(*args, **kwargs)
