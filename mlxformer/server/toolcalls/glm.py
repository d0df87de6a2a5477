"""GLM-4.5/4.6/4.7: ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>``
(llama.cpp's ``GLM-4.6.jinja`` puts newlines between the parts, ``GLM-4.7-Flash.jinja`` none;
both are read). Values are text, JSON by the parameter's schema type as Qwen3-Coder's
(``qwen3_coder.typed``: the templates write strings raw and other values as JSON). Arguments
stream one whole parameter at a time."""

from __future__ import annotations

import json

import regex

from mlxformer.server.toolcalls.base import CallFormat, Section, ToolSpec
from mlxformer.server.toolcalls.hermes import CLOSE, OPEN
from mlxformer.server.toolcalls.jsoncalls import lark_json, lark_literal, skip_ws
from mlxformer.server.toolcalls.qwen3_coder import typed

_NAME = regex.compile(r"\s*([A-Za-z0-9_.:\-]+)\s*")
_ARGUMENT = regex.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", regex.DOTALL)


def _text_value(schema: dict) -> str:
    """The grammar of one ``<arg_value>``: strings raw (one of an enum's, or any text without
    "<"), other values as JSON, as the templates write them."""
    choices = schema.get("enum")
    if choices and all(isinstance(c, str) for c in choices):
        return "(" + " | ".join(lark_literal(c) for c in choices) + ")"
    return "/[^<]*/" if schema.get("type") == "string" else lark_json(schema)


class Glm(CallFormat):
    name = "glm"
    markers = (OPEN,)
    separator = "\n"  # between the parts of a forced call (GLM-4.5/4.6)

    def read(self, marker: str, body: str, final: bool, tools: ToolSpec) -> Section:
        name = _NAME.match(body)
        if name is None or (name.end() == len(body) and not final):  # the name may still grow
            return Section(failed=name is None and bool(body.strip()) or final)
        if name.end() < len(body) and body[name.end()] != "<":
            return Section(failed=True)
        properties = tools.parameters.get(name.group(1), {}).get("properties", {})
        pos, fields = name.end(), []
        while (argument := _ARGUMENT.match(body, pos)) is not None:
            key = argument.group(1).strip()
            value = typed(argument.group(2), properties.get(key, {}) if isinstance(properties, dict) else {})
            fields.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
            pos = skip_ws(body, argument.end())
        arguments = "{" + ", ".join(fields)
        if body.startswith(CLOSE, pos):
            return Section(calls=[(name.group(1), arguments + "}")], end=pos + len(CLOSE))
        if final:
            return Section(calls=[(name.group(1), arguments + "}")], end=len(body))
        if _ARGUMENT.match(body, pos, partial=True) is None and not CLOSE.startswith(body[pos : pos + len(CLOSE)]):
            return Section(failed=True)  # neither an argument nor the end coming: no call after all
        return Section(calls=[(name.group(1), arguments)])

    def forced_grammar(self, names: list[str], tools: ToolSpec) -> str:
        rules, branches, sep = [], [], self.separator
        for i, name in enumerate(names):
            parameters = tools.parameters[name]
            properties = parameters.get("properties", {}) or {}
            parts = [lark_literal(f"{OPEN}{name}{sep}")]
            for key in parameters.get("required", []) or []:
                schema = properties.get(key, {})
                value = _text_value(schema)
                parts += [lark_literal(f"<arg_key>{key}</arg_key>{sep}<arg_value>"), value,
                          lark_literal(f"</arg_value>{sep}")]
            parts.append(lark_literal(CLOSE))
            rules.append(f"call{i}: " + " ".join(parts))
            branches.append(f"call{i}")
        return "\n".join(["start: " + " | ".join(branches), *rules])


class Glm47(Glm):
    """GLM-4.7's form: no newlines between the parts of a call."""

    name = "glm47"
    separator = ""
