"""Turn ``response_format`` / ``regex`` / ``grammar`` into one llguidance grammar, checked
against the tokenizer before any generation (a bad schema or grammar is a one-line error)."""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from mlxformer.errors import MlxformerError

# Between JSON tokens: at most this much whitespace, so that a small model cannot loop on blanks
# forever, yet pretty-printed output (newline + indentation) still conforms.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,24}"

_GBNF_RULE = re.compile(r"(?m)^\s*[A-Za-z][\w-]*\s*::=")


def response_format_schema(response_format: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON Schema a ``response_format`` asks for, or ``None`` for plain text.

    Accepts a JSON Schema itself, ``{"type": "json_object"}`` (any JSON object), ``{"type": "text"}``
    and OpenAI's ``{"type": "json_schema", "json_schema": {"name": ..., "schema": ...}}``.
    """
    if not isinstance(response_format, dict):
        raise MlxformerError(f"response_format must be a JSON object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None:
            return {"type": "object"}  # OpenAI: a json_schema without "schema" is any JSON object
        if not isinstance(schema, (dict, bool)):
            raise MlxformerError("response_format.json_schema.schema must be a JSON Schema object")
        return schema if isinstance(schema, dict) else {} if schema else {"not": {}}
    return response_format


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def closed_schema(schema: Any) -> Any:
    """``schema`` with every object that lists ``properties`` but says nothing of
    ``additionalProperties`` closed (``"additionalProperties": false``), as llama.cpp's and
    xgrammar's JSON-schema grammars do: a small model cannot then add keys until ``max_tokens``.
    ``"additionalProperties": true`` keeps extra keys allowed."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    result = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(result.get(key), list):
            result[key] = [closed_schema(s) for s in result[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(result.get(key), dict):
            result[key] = {name: closed_schema(s) for name, s in result[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(result.get(key), dict):
            result[key] = closed_schema(result[key])
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if isinstance(result.get("properties"), dict) and not any(k in result for k in open_keys):
        result["additionalProperties"] = False
    return result


def is_gbnf(text: str) -> bool:
    """Whether grammar text is llama.cpp GBNF (``rule ::= ...``) rather than Lark (``rule: ...``)."""
    return _GBNF_RULE.search(text) is not None


def lark_from_gbnf(text: str) -> str:
    """Convert a llama.cpp GBNF grammar to llguidance's Lark dialect."""
    try:
        return gbnf_to_lark(text)
    except Exception as exc:  # the converter raises its own error types and plain ValueErrors
        raise MlxformerError(f"cannot convert the GBNF grammar: {_one_line(exc)}") from exc


def grammar_spec(
    response_format: dict[str, Any] | None = None, regex: str | None = None, grammar: str | None = None
) -> tuple[str, str] | None:
    """``(llguidance grammar, what it came from)`` for the one constraint given, or ``None``.

    ``grammar`` is Lark (llguidance's dialect) or GBNF, told apart by its rule syntax.
    """
    given = [name for name, value in (("response_format", response_format), ("regex", regex), ("grammar", grammar))
             if value is not None]
    if len(given) > 1:
        raise MlxformerError(f"give at most one of response_format, regex and grammar (got {', '.join(given)})")
    if response_format is not None:
        schema = response_format_schema(response_format)
        if schema is None:
            return None
        try:
            compiled = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(closed_schema(schema)), defaults={"whitespace_pattern": JSON_WHITESPACE}
            )
        except (ValueError, TypeError) as exc:
            raise MlxformerError(f"invalid JSON schema: {_one_line(exc)}") from exc
        return compiled, "JSON schema"
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise MlxformerError("regex must be a non-empty string")
        return llguidance.LLMatcher.grammar_from_regex(regex), "regex"
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise MlxformerError("grammar must be a non-empty string")
        if is_gbnf(grammar):
            return llguidance.LLMatcher.grammar_from_lark(lark_from_gbnf(grammar)), "GBNF grammar"
        return llguidance.LLMatcher.grammar_from_lark(grammar), "Lark grammar"
    return None


def check_grammar(compiled: str, source: str, tokenizer: llguidance.LLTokenizer | None = None) -> None:
    """Raise a one-line ``MlxformerError`` if llguidance cannot compile the grammar (without a
    tokenizer: the checks that need no vocabulary, cheap enough to run before loading a model)."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled, tokenizer)
    if is_error:
        raise MlxformerError(f"cannot compile the {source}: {_one_line(messages[0] if messages else 'unknown error')}")


def validate_structured_output(
    response_format: dict[str, Any] | None = None, regex: str | None = None, grammar: str | None = None
) -> None:
    """Raise a one-line ``MlxformerError`` now if the constraint given cannot compile."""
    spec = grammar_spec(response_format, regex, grammar)
    if spec is not None:
        check_grammar(*spec)


def _one_line(message: object) -> str:
    return " ".join(str(message).split())
