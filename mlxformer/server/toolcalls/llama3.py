"""Llama 3.1 / 3.2 / 3.3: a JSON object ``{"name": ..., "parameters": {...}}`` as the whole
reply, or after ``<|python_tag|>`` (calls may be joined by ``;``) (Meta's chat templates)."""

from __future__ import annotations

from mlxformer.server.toolcalls.base import CallFormat, Section, ToolSpec
from mlxformer.server.toolcalls.jsoncalls import call_schema, lark_json, read_calls

PYTHON_TAG = "<|python_tag|>"


class Llama3Json(CallFormat):
    name = "llama3_json"
    markers = (PYTHON_TAG,)
    bare_json = True

    def read(self, marker: str, body: str, final: bool, tools: ToolSpec) -> Section:
        return read_calls(body, 0, final, names=None if marker else tools.names, separators=";", listed=False)

    def forced_grammar(self, names: list[str], tools: ToolSpec) -> str:
        return f"start: {lark_json(call_schema(names, tools, 'parameters'))}"
