"""Qwen3-Coder: ``<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</function>\n</tool_call>``
(the Qwen3-Coder chat template). Values are text; they become JSON by the parameter's schema
type (strings stay strings, numbers, booleans, objects and arrays are parsed), as Qwen's own
parser does. Arguments stream one whole parameter at a time."""

from __future__ import annotations

import json
from typing import Any

import regex

from mlxformer.server.toolcalls.base import CallFormat, Section, ToolSpec
from mlxformer.server.toolcalls.hermes import CLOSE, OPEN, closed_by
from mlxformer.server.toolcalls.jsoncalls import lark_json, lark_literal, skip_ws

FUNCTION = "<function="
_FUNCTION = regex.compile(r"<function=([^>\n]+)>")
_PARAMETER = regex.compile(r"<parameter=([^>\n]+)>\n?")
END_PARAMETER = "</parameter>"
END_FUNCTION = "</function>"


def typed(value: str, schema: dict[str, Any]) -> Any:
    """A parameter's text as the JSON value its schema asks for."""
    kind = schema.get("type")
    if kind == "string" or (kind is None and "enum" in schema and all(isinstance(e, str) for e in schema["enum"])):
        return value
    if kind == "boolean" and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


class Qwen3Coder(CallFormat):
    name = "qwen3_coder"
    markers = (OPEN, FUNCTION)

    def read(self, marker: str, body: str, final: bool, tools: ToolSpec) -> Section:
        text = FUNCTION + body if marker == FUNCTION else body
        pos = skip_ws(text, 0)
        function = _FUNCTION.match(text, pos, partial=True)
        if function is None:
            return Section(failed=True)
        if function.partial:
            return Section(failed=final)
        name = function.group(1).strip()
        properties = tools.parameters.get(name, {}).get("properties", {})
        pos, fields = function.end(), []
        while True:
            pos = skip_ws(text, pos)
            parameter = _PARAMETER.match(text, pos)
            close = -1 if parameter is None else text.find(END_PARAMETER, parameter.end())
            if parameter is None or close < 0:
                break
            raw = text[parameter.end():close]
            key = parameter.group(1).strip()
            value = typed(raw[:-1] if raw.endswith("\n") else raw,
                          properties.get(key, {}) if isinstance(properties, dict) else {})
            fields.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
            pos = close + len(END_PARAMETER)
        arguments, shift = "{" + ", ".join(fields), len(text) - len(body)
        if not text.startswith(END_FUNCTION, pos):
            return Section(calls=[(name, arguments + "}")], end=len(body)) if final else Section(calls=[(name, arguments)])
        section = Section(calls=[(name, arguments + "}")], end=pos + len(END_FUNCTION) - shift)
        return closed_by(body, section, CLOSE, final) if marker == OPEN else section

    def forced_grammar(self, names: list[str], tools: ToolSpec) -> str:
        rules, branches = [], []
        for i, name in enumerate(names):
            parameters = tools.parameters[name]
            properties = parameters.get("properties", {}) or {}
            parts = [lark_literal(f"{OPEN}\n{FUNCTION}{name}>\n")]
            for key in parameters.get("required", []) or []:
                schema = properties.get(key, {})
                if schema.get("type") == "string":  # any text without "<", its closing newline included
                    parts += [lark_literal(f"<parameter={key}>\n"), "/[^<]*/", lark_literal("</parameter>\n")]
                else:
                    parts += [lark_literal(f"<parameter={key}>\n"), lark_json(schema), lark_literal("\n</parameter>\n")]
            parts.append(lark_literal(f"{END_FUNCTION}\n{CLOSE}"))
            rules.append(f"call{i}: " + " ".join(parts))
            branches.append(f"call{i}")
        return "\n".join(["start: " + " | ".join(branches), *rules])
