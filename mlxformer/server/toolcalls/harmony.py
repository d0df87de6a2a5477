"""Harmony, gpt-oss's format: a reply is a run of messages, each a header and a body,
``<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>``.

The ``analysis`` channel is reasoning, ``final`` (and ``commentary`` without a recipient, a
preamble) is content, and a message to ``functions.NAME``
(``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``, or the
recipient before the channel, as the chat template renders earlier calls) is a call whose body
is the arguments. Headers and the control tokens (``<|start|>``, ``<|channel|>``,
``<|message|>``, ``<|constrain|>``, ``<|end|>``, ``<|return|>``, ``<|call|>``) are never content.
``HarmonyStream`` reads a reply piece by piece (the same object reads it whole) and holds back
only what may still become a control token, so streamed and whole replies agree.
"""

from __future__ import annotations

from typing import ClassVar

import regex

from mlxformer.server.toolcalls.base import CallDelta, CallFormat, Section, ToolCall, ToolSpec
from mlxformer.server.toolcalls.jsoncalls import lark_json, lark_literal
from mlxformer.server.toolcalls.stream import Parsed, held_suffix

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
# What ends a message body (a missing <|end|> before the next <|start|> too).
BODY_ENDS = (END, RETURN, CALL, START)
_RECIPIENT = regex.compile(r"to=([^\s<]+)")
_CHANNEL = regex.compile(r"<\|channel\|>\s*(\w+)")
# Reasoning effort for the template's "Reasoning: low|medium|high" line.
EFFORTS = ("low", "medium", "high")
# A header that grows this long without <|message|> is text the model wrote outside the format.
_MAX_HEADER = 256


class Harmony(CallFormat):
    """The call format of the registry; replies are read by ``HarmonyStream`` (channels too)."""

    name = "harmony"
    channels: ClassVar[bool] = True

    def read(self, marker: str, body: str, final: bool, tools: ToolSpec) -> Section:
        raise NotImplementedError("Harmony replies are read by HarmonyStream")

    def forced_grammar(self, names: list[str], tools: ToolSpec) -> str:
        """One call, straight after the generation prompt's ``<|start|>assistant``; the control
        tokens are the vocabulary's special tokens (llguidance's bare ``<|name|>`` syntax)."""
        branches = [
            f"{CHANNEL} {lark_literal(f'commentary to=functions.{name} ')} {CONSTRAIN} {lark_literal('json')} {MESSAGE} "
            f"{lark_json(tools.parameters[name])} {CALL}" for name in names
        ]
        return "start: " + " | ".join(f"( {b} )" for b in branches)


class HarmonyStream:
    """Incremental reading of one Harmony reply: reasoning, content and call deltas."""

    def __init__(self, fmt: CallFormat, tools: ToolSpec) -> None:
        self.fmt, self.tools = fmt, tools
        self.buffer = ""
        self.kind: str | None = None  # None: in a header; else "reasoning", "content" or "call"
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> Parsed:
        """Read the next piece of the reply."""
        self.buffer += text
        return self._advance(final=False)

    def finish(self) -> Parsed:
        """The end of the reply: an open body is closed as it is, an open header dropped."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> Parsed:
        out = Parsed()
        while self._header(out, final) if self.kind is None else self._body(out, final):
            pass
        return out

    def _header(self, out: Parsed, final: bool) -> bool:
        """Open the next message's body once its header is whole (True)."""
        at = self.buffer.find(MESSAGE)
        if at < 0:
            if "<|" not in self.buffer and (final or len(self.buffer) > _MAX_HEADER):
                self.kind = "content"  # text outside the format: shown as it is
                return bool(self.buffer)
            if final:
                self.buffer = ""
            return False
        header, self.buffer = self.buffer[:at], self.buffer[at + len(MESSAGE):]
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        if recipient is not None and recipient.group(1).startswith("functions."):
            self.kind = "call"
            call = ToolCall(self.fmt.new_id(), recipient.group(1)[len("functions."):], "")
            self.calls.append(call)
            out.calls.append(CallDelta(len(self.calls) - 1, id=call.id, name=call.name))
        else:
            self.kind = "reasoning" if channel is not None and channel.group(1) == "analysis" else "content"
        return True

    def _body(self, out: Parsed, final: bool) -> bool:
        """Hand out the open body's text; True when it ended (a header comes next)."""
        found = [(self.buffer.find(t), t) for t in BODY_ENDS if t in self.buffer]
        if found:
            at, token = min(found)
            text, self.buffer = self.buffer[:at], self.buffer[at + (0 if token == START else len(token)):]
        else:
            keep = 0 if final else held_suffix(self.buffer, BODY_ENDS)
            text, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        self._emit(out, text)
        if found:
            self.kind = None
            if self.buffer.startswith(START):
                self.buffer = self.buffer[len(START):]
        return bool(found)

    def _emit(self, out: Parsed, text: str) -> None:
        if not text:
            return
        if self.kind == "reasoning":
            out.reasoning += text
        elif self.kind == "content":
            out.content += text
        else:
            call = self.calls[-1]
            call.arguments += text
            out.calls.append(CallDelta(len(self.calls) - 1, arguments=text))


def harmony_messages(messages: list[dict]) -> list[dict]:
    """OpenAI-style messages as the gpt-oss template reads them: an assistant turn's
    ``reasoning_content`` as ``thinking`` (the template keeps it only before a call, and takes
    a call's analysis from ``thinking`` or ``content``, not both: the reasoning wins)."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("reasoning_content") and "thinking" not in m:
            m = {**m, "thinking": m["reasoning_content"]}
            if m.get("tool_calls") and m.get("content"):
                m["content"] = ""
        out.append(m)
    return out
