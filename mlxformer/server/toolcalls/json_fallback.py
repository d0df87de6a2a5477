"""The fallback for templates with no call format of their own (tools are then described in the
system message): a reply that is a JSON call, or a ``[...]`` list of them, bare or in a ```json
fence, naming one of the offered functions; ``<tool_call>`` tags are read too."""

from __future__ import annotations

from mlxformer.server.toolcalls.base import Section, ToolSpec
from mlxformer.server.toolcalls.hermes import Hermes
from mlxformer.server.toolcalls.jsoncalls import call_schema, lark_json, read_calls, skip_ws

FENCE = "```"


class JsonFallback(Hermes):
    name = "json"
    bare_json = True

    def read(self, marker: str, body: str, final: bool, tools: ToolSpec) -> Section:
        if marker:
            return super().read(marker, body, final, tools)
        pos = skip_ws(body, 0)
        fenced = body.startswith(FENCE, pos)
        if fenced:
            pos += len(FENCE)
            if body.startswith("json", pos):
                pos += len("json")
        section = read_calls(body, pos, final, names=tools.names)
        if fenced and section.end is not None:
            at = skip_ws(body, section.end)
            if body.startswith(FENCE, at):
                section.end = at + len(FENCE)
            elif FENCE.startswith(body[at:]) and not final:
                section.end = None
        return section

    def forced_grammar(self, names: list[str], tools: ToolSpec) -> str:
        return f"start: {lark_json(call_schema(names, tools))}"
