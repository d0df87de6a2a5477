"""Reading JSON tool calls (``{"name": ..., "arguments": {...}}``) out of text that may still be
growing: the call's name once it is complete, then its arguments as the raw text written so far."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import regex

from mlxformer.constrained import closed_schema
from mlxformer.constrained.tools import call_schema as function_call_schema
from mlxformer.server.toolcalls.base import Section, ToolSpec

_WS = " \t\r\n"
# An object that names the function first: {"name": "f", "arguments": ... (or "parameters")
_NAME_FIRST = regex.compile(
    r'\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
_NAME = regex.compile(r'\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
NEED_MORE, FAILED = "need more", "failed"


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


_STRUCTURE = regex.compile(r'["{}\[\]]')  # what changes the nesting outside a string
_STRING_END = regex.compile(r'\\.|"', regex.DOTALL)  # inside a string: an escape, or its end


def value_end(text: str, pos: int) -> int | None:
    """The end of the JSON object, array or string starting at ``text[pos]`` (``None``: not complete
    yet). The scan jumps between the characters that matter, so plain text costs no Python steps."""
    depth, i = 0, pos
    while True:
        found = _STRUCTURE.search(text, i)
        if found is None:
            return None
        c, i = found.group(), found.end()
        if c == '"':
            while (escape := _STRING_END.search(text, i)) is not None and escape.group() != '"':
                i = escape.end()
            if escape is None:
                return None
            i = escape.end()
            if depth == 0:
                return i
        elif c in "{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return i


@dataclass
class JsonCall:
    name: str
    arguments: str
    end: int | None  # end of the call object in the text; None while it is open


def read_call(text: str, pos: int, final: bool, names: set[str] | None = None) -> JsonCall | str:
    """The call object at ``text[pos]`` (after whitespace): a ``JsonCall`` (perhaps still open),
    ``NEED_MORE`` or ``FAILED``. With ``names``, a call of another function is ``FAILED``."""
    pos = skip_ws(text, pos)
    if pos >= len(text):
        return FAILED if final else NEED_MORE
    if text[pos] != "{":
        return FAILED
    named = _NAME.match(text, pos, partial=True)
    if named is None:
        return FAILED
    if not named.partial and names is not None and _unescape(named.group(1)) not in names:
        return FAILED
    match = _NAME_FIRST.match(text, pos, partial=True)
    if match is not None and not match.partial and text[match.end():match.end() + 1] in ("{", ""):
        name, start = _unescape(match.group(1)), match.end()
        if start == len(text):
            return FAILED if final else JsonCall(name, "", None)
        end = value_end(text, start)
        if end is None:
            return JsonCall(name, text[start:], None)
        close = skip_ws(text, end)
        if close < len(text) and text[close] == "}":
            return JsonCall(name, text[start:end], close + 1)
        if close < len(text) and text[close] == ",":  # more keys (e.g. Mistral's "id") after the arguments
            whole = value_end(text, pos)
            if whole is not None or not final:
                return JsonCall(name, text[start:end], whole)
        if close >= len(text) and not final:
            return JsonCall(name, text[start:end], None)
        return FAILED
    if match is not None and match.partial and not final:
        return NEED_MORE
    return _whole_object(text, pos, final, names)


def _whole_object(text: str, pos: int, final: bool, names: set[str] | None) -> JsonCall | str:
    """A call written in another key order: read once the object is complete."""
    end = value_end(text, pos)
    if end is None:
        return FAILED if final else NEED_MORE
    try:
        value: Any = json.loads(text[pos:end])
    except json.JSONDecodeError:
        return FAILED
    arguments = value.get("arguments", value.get("parameters")) if isinstance(value, dict) else None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return FAILED
    name = value.get("name") if isinstance(value, dict) else None
    if not isinstance(name, str) or not isinstance(arguments, dict) or (names is not None and name not in names):
        return FAILED
    return JsonCall(name, json.dumps(arguments, ensure_ascii=False), end)


def read_calls(text: str, pos: int, final: bool, *, names: set[str] | None = None, separators: str = ",",
               listed: bool | None = None) -> Section:
    """A section of JSON calls at ``text[pos]``: one object, or (``listed`` None or True) a
    ``[...]`` list of them, or objects joined by one of ``separators``. ``Section.end`` is the
    end of the last call (or of the list)."""
    start = skip_ws(text, pos)
    if start >= len(text):
        return Section(failed=final)
    in_list = text[start] == "["
    if listed is False and in_list or listed is True and not in_list:
        return Section(failed=True)
    pos = start + 1 if in_list else start
    section = Section()
    while True:
        call = read_call(text, pos, final, names)
        if call == NEED_MORE:
            return section
        if call == FAILED:
            if section.calls:  # text after a complete call: the section ends there
                section.end = pos
                return section
            return Section(failed=True)
        assert isinstance(call, JsonCall)
        section.calls.append((call.name, call.arguments))
        if call.end is None:
            return section
        pos = skip_ws(text, call.end)
        if in_list and pos < len(text) and text[pos] == "]":
            section.end = pos + 1
            return section
        if pos < len(text) and text[pos] in separators:
            pos += 1
            continue
        if pos >= len(text) and not final:
            return section
        section.end = call.end
        return section


def call_schema(names: list[str], tools: ToolSpec, arguments_key: str = "arguments") -> dict[str, Any]:
    """The JSON Schema of one call of any of ``names`` (``arguments_key``: what the format calls the arguments)."""
    return function_call_schema(tools.parameters, names, arguments_key)


def lark_literal(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text)


def lark_json(schema: dict[str, Any]) -> str:
    """An inline llguidance JSON-Schema rule."""
    return "%json " + json.dumps(closed_schema(schema))


def _unescape(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except json.JSONDecodeError:
        return raw
