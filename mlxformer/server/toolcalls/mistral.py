"""Mistral: ``[TOOL_CALLS]`` then a JSON list of calls (v3 tokenizers: Mistral 7B v0.3, Nemo)
or ``name[ARGS]{...}`` (v11+: Mistral Small 3.2, Devstral, Magistral); both forms are read by
either parser, which differ in the form a forced call is written in."""

from __future__ import annotations

import secrets

import regex

from mlxformer.server.toolcalls.base import CallFormat, Section, ToolSpec
from mlxformer.server.toolcalls.jsoncalls import (
    call_schema, lark_json, lark_literal, read_calls, skip_ws, value_end,
)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAMED = regex.compile(r"([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]")
ID_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


class Mistral(CallFormat):
    name = "mistral"
    markers = (TOOL_CALLS,)

    def new_id(self) -> str:
        """Mistral's templates want call ids of 9 letters and digits."""
        return "".join(secrets.choice(ID_ALPHABET) for _ in range(9))

    def read(self, marker: str, body: str, final: bool, tools: ToolSpec) -> Section:
        pos = skip_ws(body, 0)
        if pos < len(body) and body[pos] in "[{":
            return read_calls(body, pos, final)
        match = _NAMED.match(body, pos, partial=True)
        if match is None or pos >= len(body):
            return Section(failed=match is None or final)
        if match.partial:
            return Section(failed=final)
        start = match.end()
        end = value_end(body, start) if body[start:start + 1] == "{" else None
        if start < len(body) and body[start] != "{":
            return Section(failed=True)
        arguments = body[start:end] if end is not None else body[start:]
        return Section(calls=[(match.group(1), arguments)], end=end)

    def forced_grammar(self, names: list[str], tools: ToolSpec) -> str:
        schema = call_schema(names, tools)
        for branch in schema.get("anyOf", [schema]):  # the call's id, as Mistral's templates write it
            branch["properties"]["id"] = {"type": "string", "pattern": "^[A-Za-z0-9]{9}$"}
        return f"start: {lark_literal(TOOL_CALLS)} \"[\" {lark_json(schema)} \"]\""


class MistralV11(Mistral):
    name = "mistral_v11"

    def forced_grammar(self, names: list[str], tools: ToolSpec) -> str:
        branches = [f"{lark_literal(TOOL_CALLS + name + ARGS)} {lark_json(tools.parameters[name])}" for name in names]
        return "start: " + " | ".join(branches)
