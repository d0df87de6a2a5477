"""Gemma 4: ``<|tool_call>call:NAME{key:value,...}<tool_call|>`` (the Gemma 4 chat template), one
marker per call. Values are Gemma's own notation: strings between ``<|"|>`` delimiters, bare
keys, ``true``/``false``, numbers, ``{...}`` and ``[...]``; they become JSON arguments. Arguments
stream one whole top-level field at a time (as Qwen3-Coder's)."""

from __future__ import annotations

import json
from typing import Any

import regex

from mlxformer.server.toolcalls.base import CallFormat, Section, ToolSpec
from mlxformer.server.toolcalls.jsoncalls import lark_literal, skip_ws

OPEN, CLOSE, CALL, QUOTE = "<|tool_call>", "<tool_call|>", "call:", '<|"|>'
_NAME = regex.compile(r"call:([A-Za-z0-9_.\-]+)\{")
_KEY = regex.compile(r"([A-Za-z0-9_.\-]+):")
_BARE = regex.compile(r"[^,}\]<]+")
INCOMPLETE = object()  # a value the text does not finish yet


def read_value(text: str, pos: int) -> tuple[Any, int]:
    """The value at ``pos`` and where it ends; ``(INCOMPLETE, pos)`` when the text stops inside
    it; ``ValueError`` when it is no value."""
    if text.startswith(QUOTE, pos):
        end = text.find(QUOTE, pos + len(QUOTE))
        return (INCOMPLETE, pos) if end < 0 else (text[pos + len(QUOTE):end], end + len(QUOTE))
    if QUOTE.startswith(text[pos:]) or pos >= len(text):
        return INCOMPLETE, pos
    if text[pos] in "{[":
        closing, items, obj = ("}" if text[pos] == "{" else "]"), [], text[pos] == "{"
        at = pos + 1
        while True:
            if at >= len(text):
                return INCOMPLETE, pos
            if text[at] == closing:
                return (dict(items) if obj else items), at + 1
            if items:
                if text[at] != ",":
                    raise ValueError(f"expected ',' at {at}")
                at += 1
            if obj:
                key, at = read_key(text, at)
                if key is INCOMPLETE:
                    return INCOMPLETE, pos
            value, at = read_value(text, at)
            if value is INCOMPLETE:
                return INCOMPLETE, pos
            items.append((key, value) if obj else value)
    bare = _BARE.match(text, pos)
    if bare is None:
        raise ValueError(f"no value at {pos}")
    if bare.end() >= len(text):
        return INCOMPLETE, pos  # a number may go on
    word = bare.group(0).strip()
    try:
        return json.loads(word), bare.end()
    except json.JSONDecodeError:
        return word, bare.end()


def read_key(text: str, pos: int) -> tuple[Any, int]:
    """An object key (bare, or quoted by ``<|"|>``) and its ``:``, or ``(INCOMPLETE, pos)``."""
    if text.startswith(QUOTE, pos) or QUOTE.startswith(text[pos:]):
        key, end = read_value(text, pos)
        if key is INCOMPLETE or end >= len(text):
            return INCOMPLETE, pos
        if text[end] != ":":
            raise ValueError(f"expected ':' at {end}")
        return key, end + 1
    match = _KEY.match(text, pos, partial=True)
    if match is None:
        raise ValueError(f"no key at {pos}")
    return (INCOMPLETE, pos) if match.partial else (match.group(1), match.end())


class Gemma4(CallFormat):
    name = "gemma4"
    markers = (OPEN,)

    def read(self, marker: str, body: str, final: bool, tools: ToolSpec) -> Section:
        pos = skip_ws(body, 0)
        head = _NAME.match(body, pos, partial=True)
        if head is None or (head.partial and final):
            return Section(failed=True)
        if head.partial:
            return Section()
        fields, pos = [], head.end()
        try:
            while pos < len(body) and body[pos] != "}":
                at = pos + 1 if fields and body[pos] == "," else pos
                if fields and body[pos] != ",":
                    raise ValueError(f"expected ',' at {pos}")
                key, at = read_key(body, at)
                value, at = (INCOMPLETE, at) if key is INCOMPLETE else read_value(body, at)
                if value is INCOMPLETE:
                    break
                fields.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
                pos = at
        except ValueError:
            return Section(failed=True)
        arguments = "{" + ", ".join(fields)
        if pos < len(body) and body[pos] == "}":
            closing = body[pos + 1:pos + 1 + len(CLOSE)]
            if closing == CLOSE:
                return Section(calls=[(head.group(1), arguments + "}")], end=pos + 1 + len(CLOSE))
            if not CLOSE.startswith(closing) or final:
                return Section(failed=True)
        if final:
            return Section(failed=True)
        return Section(calls=[(head.group(1), arguments)])

    def forced_grammar(self, names: list[str], tools: ToolSpec) -> str:
        rules = [_VALUE_RULES]
        branches = []
        for i, name in enumerate(names):
            rules.append(f"call{i}: {lark_literal(OPEN + CALL + name)} {_object(tools.parameters[name])} "
                         f"{lark_literal(CLOSE)}")
            branches.append(f"call{i}")
        return "\n".join(["start: " + " | ".join(branches), *rules])


# Any value in Gemma's notation (for schemas without a narrower rule).
_VALUE_RULES = "\n".join([
    'gvalue: gstring | gnumber | "true" | "false" | "null" | gobject | garray',
    'gstring: "<|\\"|>" /[^<]*/ "<|\\"|>"',
    "gnumber: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][-+]?[0-9]+)?/",
    'gobject: "{" (gkey ":" gvalue ("," gkey ":" gvalue)*)? "}"',
    "gkey: /[A-Za-z_][A-Za-z0-9_]*/",
    'garray: "[" (gvalue ("," gvalue)*)? "]"',
])


def _object(schema: dict[str, Any]) -> str:
    """A Lark expression of an object of ``schema``: its required keys in sorted order (as the
    template writes them), each value by its own schema."""
    properties = schema.get("properties") or {}
    required = sorted(schema.get("required") or [])
    if not properties and not required:
        return "gobject"
    parts = [lark_literal("{")]
    for i, key in enumerate(required):
        parts.append(lark_literal(("," if i else "") + key + ":"))
        parts.append(_value(properties.get(key, {})))
    parts.append(lark_literal("}"))
    return "(" + " ".join(parts) + ")"


def _value(schema: dict[str, Any]) -> str:
    kind = schema.get("type")
    if isinstance(schema.get("enum"), list) and all(isinstance(e, str) for e in schema["enum"]):
        return "(" + " | ".join(lark_literal(QUOTE + e + QUOTE) for e in schema["enum"]) + ")"
    if kind == "string":
        length = schema.get("maxLength")
        text = f"/[^<]{{0,{length}}}/" if isinstance(length, int) and length >= 0 else "/[^<]*/"
        return f"({lark_literal(QUOTE)} {text} {lark_literal(QUOTE)})"
    if kind == "integer":
        return "/-?(0|[1-9][0-9]*)/"
    if kind == "number":
        return "gnumber"
    if kind == "boolean":
        return '("true" | "false")'
    if kind == "object":
        return _object(schema)
    if kind == "array":
        item = _value(schema.get("items") or {})
        return f'("[" ({item} ("," {item})*)? "]")'
    return "gvalue"
