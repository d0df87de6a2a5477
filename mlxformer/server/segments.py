"""A reply as a sequence of segments (reasoning, text, one per tool call), opened, extended and
closed as its deltas arrive: what the Anthropic (content blocks) and Responses (output items)
APIs stream, and what their whole responses are made of (the same events, folded)."""

from __future__ import annotations

from dataclasses import dataclass

from mlxformer.server.reply import ReplyDelta


@dataclass
class ReplySegment:
    kind: str  # "reasoning", "text" or "call"
    index: int
    text: str = ""  # the reasoning, the text, or the call's arguments so far
    call_id: str | None = None
    name: str | None = None
    closed: bool = False


@dataclass
class SegmentEvent:
    action: str  # "open", "delta" or "close"
    segment: ReplySegment
    piece: str = ""


class Segmenter:
    """Turns reply deltas into segment events; whitespace-only text between other segments is
    dropped (it would otherwise open empty-looking text blocks between tool calls)."""

    def __init__(self) -> None:
        self.segments: list[ReplySegment] = []
        self.calls: dict[int, ReplySegment] = {}  # call index -> its segment
        self.pending = ""  # whitespace that opens no text segment by itself

    @property
    def current(self) -> ReplySegment | None:
        return self.segments[-1] if self.segments and not self.segments[-1].closed else None

    def feed(self, delta: ReplyDelta) -> list[SegmentEvent]:
        """The events of one reply delta (at the reply's last delta, the last segment is closed)."""
        events: list[SegmentEvent] = []
        if delta.reasoning:
            self._extend(events, "reasoning", delta.reasoning)
        if delta.content:
            text = self.pending + delta.content
            if self.current is not None and self.current.kind == "text":
                self._extend(events, "text", text)
                self.pending = ""
            elif text.strip():
                self._extend(events, "text", text)
                self.pending = ""
            else:
                self.pending = text
        for call in delta.calls:
            if call.id is not None:
                self._close(events)
                segment = self._open(events, "call", call_id=call.id, name=call.name)
                self.calls[call.index] = segment
            if call.arguments:
                segment = self.calls[call.index]
                segment.text += call.arguments
                events.append(SegmentEvent("delta", segment, call.arguments))
        if delta.finish_reason is not None:
            self._close(events)
        return events

    def _extend(self, events: list[SegmentEvent], kind: str, piece: str) -> None:
        segment = self.current
        if segment is None or segment.kind != kind:
            self._close(events)
            segment = self._open(events, kind)
        segment.text += piece
        events.append(SegmentEvent("delta", segment, piece))

    def _open(self, events: list[SegmentEvent], kind: str, **fields: str | None) -> ReplySegment:
        segment = ReplySegment(kind, len(self.segments), **fields)  # type: ignore[arg-type]
        self.segments.append(segment)
        events.append(SegmentEvent("open", segment))
        return segment

    def _close(self, events: list[SegmentEvent]) -> None:
        segment = self.current
        if segment is not None:
            segment.closed = True
            events.append(SegmentEvent("close", segment))
