"""Where a model comes from: a local path as is, or a Hugging Face repo id resolved through
``huggingface_hub`` (honouring ``HF_HUB_OFFLINE`` and the HF cache)."""

from __future__ import annotations

import re
from pathlib import Path

from mlxformer.errors import MlxformerError
from mlxformer.formats.safetensors import WEIGHT_GLOB

# Only data files are fetched: never pickles, never code. The weights are ``model*.safetensors``
# (as mlx-lm fetches them): a Mistral repo's ``consolidated.safetensors`` copy is left out.
HUB_ALLOW_PATTERNS = ["*.json", WEIGHT_GLOB, "tokenizer.model", "*.jinja", "*.txt"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_source(path_or_repo: str | Path) -> Path:
    """A local path as is; otherwise a hub repo id fetched (or found in the HF cache) via huggingface_hub."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        return path
    text = str(path_or_repo)
    if not _REPO_ID.match(text) or text.endswith(".gguf"):
        raise MlxformerError(f"no such file or directory: {text}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(text, allow_patterns=HUB_ALLOW_PATTERNS))
    except (LocalEntryNotFoundError, RepositoryNotFoundError, HfHubHTTPError, OSError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MlxformerError(f"{text}: not a local path, and the hub repo could not be fetched ({reason})") from None
