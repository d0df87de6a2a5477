"""Reading JSON objects from model dirs, with one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlxformer.errors import MlxformerError


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; unreadable, malformed or non-object content raises."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MlxformerError(f"{path}: cannot read JSON ({exc})") from None
    if not isinstance(data, dict):
        raise MlxformerError(f"{path}: expected a JSON object")
    return data
