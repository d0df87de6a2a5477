"""Structured-output flags: ``--json-schema``, ``--regex`` and ``--grammar``, read into the
keywords of ``mlxformer.constrained.make_constraint``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_structured_args(parser: argparse.ArgumentParser) -> None:
    """The three mutually exclusive constraint flags."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--json-schema", metavar="FILE_OR_JSON",
                       help="constrain the output to JSON valid under this schema (a file, or inline JSON)")
    group.add_argument("--regex", metavar="PATTERN", help="constrain the output to match this regular expression")
    group.add_argument("--grammar", metavar="FILE",
                       help="constrain the output to this grammar: Lark (.lark) or llama.cpp GBNF (.gbnf); "
                            "other extensions are told apart by their rules ('::=' is GBNF)")


def structured_output_args(args: argparse.Namespace) -> dict[str, Any]:
    """``response_format``/``regex``/``grammar`` keywords from the flags (empty when none is given)."""
    import json

    from mlxformer.constrained import lark_from_gbnf
    from mlxformer.errors import MlxformerError

    if args.regex is not None:
        return {"regex": args.regex}
    if args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith("{"):
            text = _read_text(Path(text), "--json-schema")
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MlxformerError(f"--json-schema is not valid JSON: {exc}") from exc
        if not isinstance(schema, dict):
            raise MlxformerError("--json-schema must be a JSON object")
        return {"response_format": schema}
    if args.grammar is not None:
        path = Path(args.grammar)
        text = _read_text(path, "--grammar")
        return {"grammar": lark_from_gbnf(text) if path.suffix.lower() == ".gbnf" else text}
    return {}


def _read_text(path: Path, flag: str) -> str:
    from mlxformer.errors import MlxformerError

    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise MlxformerError(f"{flag}: cannot read {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise MlxformerError(f"{flag}: {path} is not UTF-8 text") from exc
