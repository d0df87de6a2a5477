"""One reply, as any API sees it: engine token events split into reasoning, content and tool-call
deltas by the model's reasoning and call parsers. Streamed replies map each ``TokenEvent`` to one
``ReplyDelta`` (carrying the event, so logprobs and usage are never lost); whole replies are the
same deltas added up, so the two cannot disagree."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxformer.engine import TokenEvent
from mlxformer.server.reasoning import ThinkSplitter
from mlxformer.server.toolcalls import CallDelta, HarmonyStream, ToolCall, ToolCallStream


@dataclass
class ReplyDelta:
    """What one engine event added to the reply."""

    event: TokenEvent
    content: str = ""
    reasoning: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    @property
    def finish_reason(self) -> str | None:
        return self.event.finish_reason


class ReplyParser:
    """Feeds a reply's events through the reasoning splitter (if the model reasons) and the
    call parser (if tools are offered)."""

    def __init__(self, splitter: ThinkSplitter | None, calls: ToolCallStream | HarmonyStream | None) -> None:
        self.splitter, self.call_stream = splitter, calls

    @property
    def calls(self) -> list[ToolCall]:
        """The calls made so far."""
        return self.call_stream.calls if self.call_stream is not None else []

    def feed(self, event: TokenEvent) -> ReplyDelta:
        """The delta of one event (at the last event everything held back is let out)."""
        final = event.finish_reason is not None
        delta = ReplyDelta(event)
        text = event.text
        if self.splitter is not None:
            split = self.splitter.feed(text, final)
            delta.reasoning, text = split.reasoning, split.content
        if self.call_stream is None:
            delta.content = text
            return delta
        parsed = self.call_stream.feed(text)
        delta.content, delta.calls = parsed.content, parsed.calls
        delta.reasoning += parsed.reasoning
        if final:
            tail = self.call_stream.finish()
            delta.content += tail.content
            delta.reasoning += tail.reasoning
            delta.calls += tail.calls
        return delta

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """The reply's finish reason: ``tool_calls`` when it made calls and stopped by itself."""
        return "tool_calls" if self.calls and engine_reason == "stop" else engine_reason


@dataclass
class Reply:
    """A whole reply."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    events: list[TokenEvent] = field(default_factory=list)

    @property
    def last(self) -> TokenEvent | None:
        return self.events[-1] if self.events else None


def whole_reply(parser: ReplyParser, events: list[TokenEvent]) -> Reply:
    """All of a finished generation's events through ``parser``."""
    reply = Reply(events=list(events))
    content, reasoning = [], []
    for event in events:
        delta = parser.feed(event)
        content.append(delta.content)
        reasoning.append(delta.reasoning)
        if event.finish_reason is not None:
            reply.finish_reason = parser.finish_reason(event.reported_finish_reason)
    reply.content, reply.reasoning, reply.calls = "".join(content), "".join(reasoning), list(parser.calls)
    return reply
