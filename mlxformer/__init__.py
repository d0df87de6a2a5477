"""mlxformer: an MLX runtime for LLaMA-family decoder LLMs.

Public API: ``load``, ``generate``, ``stream_generate`` (and ``convert`` for conversion).
"""

from .errors import MlxformerError
from .generate import GenerationResponse, SamplingSettings, generate, stream_generate
from .converter import convert
from .loader import load

__all__ = ["load", "generate", "stream_generate", "convert", "GenerationResponse", "SamplingSettings", "MlxformerError"]
__version__ = "0.1.0"

