"""DeepSeek-V3.1: ``<｜tool▁calls▁begin｜>`` then, per call,
``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{JSON arguments}<｜tool▁call▁end｜>``, then
``<｜tool▁calls▁end｜>`` (llama.cpp's ``deepseek-ai-DeepSeek-V3.1.jinja``). The arguments
stream as written."""

from __future__ import annotations

import regex

from mlxformer.server.toolcalls.base import CallFormat, Section, ToolSpec
from mlxformer.server.toolcalls.jsoncalls import lark_json, lark_literal, skip_ws, value_end

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
_HEAD = regex.compile(regex.escape(CALL_BEGIN) + r"\s*([A-Za-z0-9_.:\-]+)\s*" + regex.escape(SEP))


class DeepSeekV31(CallFormat):
    name = "deepseek_v3_1"
    markers = (CALLS_BEGIN,)

    def read(self, marker: str, body: str, final: bool, tools: ToolSpec) -> Section:
        calls: list[tuple[str, str]] = []
        pos = skip_ws(body, 0)
        while True:
            head = _HEAD.match(body, pos, partial=True)
            if head is None or head.partial:
                if body.startswith(CALLS_END, pos):
                    return Section(calls=calls, end=pos + len(CALLS_END))
                waiting = head is not None or CALLS_END.startswith(body[pos:])
                if final or not waiting:
                    return Section(calls=calls, end=pos) if calls else Section(failed=True)
                return Section(calls=calls)
            start = skip_ws(body, head.end())
            end = value_end(body, start) if body[start:start + 1] == "{" else None
            if start < len(body) and body[start] != "{":
                return Section(failed=True)
            if end is None:
                calls.append((head.group(1), body[start:]))
                return Section(calls=calls, end=len(body) if final else None)
            calls.append((head.group(1), body[start:end]))
            pos = skip_ws(body, end)
            if body.startswith(CALL_END, pos):
                pos = skip_ws(body, pos + len(CALL_END))
            elif final or not CALL_END.startswith(body[pos:]):
                return Section(calls=calls, end=pos)
            else:
                return Section(calls=calls)

    def forced_grammar(self, names: list[str], tools: ToolSpec) -> str:
        branches = [f"{lark_literal(CALL_BEGIN + name + SEP)} {lark_json(tools.parameters[name])}" for name in names]
        return (f"start: {lark_literal(CALLS_BEGIN)} call {lark_literal(CALL_END + CALLS_END)}\n"
                f"call: " + " | ".join(branches))
