"""Hermes / Qwen2.5 / Qwen3: ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``,
one tag per call (NousResearch Hermes 2 Pro and 3, Qwen2.5 and Qwen3 chat templates)."""

from __future__ import annotations

from mlxformer.server.toolcalls.base import CallFormat, Section, ToolSpec
from mlxformer.server.toolcalls.jsoncalls import call_schema, lark_json, lark_literal, read_calls, skip_ws

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def closed_by(body: str, section: Section, close: str, final: bool) -> Section:
    """``section`` ended by the tag ``close`` after its calls (waiting while the tag may still come)."""
    if section.failed or section.end is None:
        return section
    at = skip_ws(body, section.end)
    rest = body[at:at + len(close)]
    if rest == close:
        section.end = at + len(close)
    elif close.startswith(rest) and not final:
        section.end = None  # the closing tag may be coming
    return section


class Hermes(CallFormat):
    name = "hermes"
    markers = (OPEN,)

    def read(self, marker: str, body: str, final: bool, tools: ToolSpec) -> Section:
        return closed_by(body, read_calls(body, 0, final, listed=False, separators=""), CLOSE, final)

    def forced_grammar(self, names: list[str], tools: ToolSpec) -> str:
        return f"start: {lark_literal(OPEN + chr(10))} {lark_json(call_schema(names, tools))} {lark_literal(chr(10) + CLOSE)}"
