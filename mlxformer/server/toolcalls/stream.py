"""``ToolCallStream``: text in, content and call deltas out, holding back only what may still be
the start of a call marker. The same object parses a whole reply (``feed`` it all, then
``finish``), so streamed and unstreamed replies agree."""

from __future__ import annotations

from dataclasses import dataclass, field

import regex

from mlxformer.server.toolcalls.base import CallDelta, CallFormat, ToolCall, ToolSpec

# How a reply that is a bare JSON call begins (optional ```json fence, optional list).
_BARE_START = regex.compile(
    r'\s*(?:```(?:json)?\s*)?(?:\[\s*)?\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*"'
)


@dataclass
class Parsed:
    """What one piece of text added: content to show, and call deltas."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)
    reasoning: str = ""  # formats with channels (Harmony)


def held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that begins some marker (and may complete it)."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-n:]):
                longest = n
                break
    return longest


# An open section is read again only when it grew by 1/RE_READ_FRACTION since the last read
# (beyond its first LINEAR_FROM characters), so parsing a reply is linear in its length: each
# read is linear in the section, and the sections read grow geometrically. Call deltas of a long
# argument lag its text by at most that fraction; ``finish`` reads whatever is left.
LINEAR_FROM, RE_READ_FRACTION = 1024, 16


class ToolCallStream:
    """Incremental parsing of one reply in ``fmt`` (calls of the functions in ``tools``)."""

    def __init__(self, fmt: CallFormat, tools: ToolSpec) -> None:
        self.fmt, self.tools = fmt, tools
        self.buffer = ""  # text not yet handed out (or the open section's body)
        self.marker: str | None = None  # the marker of the open section
        self.started = False  # content other than whitespace was handed out (no bare JSON call now)
        self.calls: list[ToolCall] = []
        self.section_first = 0  # index of the open section's first call
        self.read_at = 0  # the open section's length when it was last read

    def feed(self, text: str) -> Parsed:
        """Parse the next piece of the reply."""
        self.buffer += text
        return self._advance(final=False)

    def finish(self) -> Parsed:
        """The end of the reply: what was held is content, an open call is closed as it is."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> Parsed:
        out = Parsed()
        while True:
            if self.marker is None:
                if not self._open_section(out, final):
                    return out
            elif not self._read_section(out, final):
                return out

    def _open_section(self, out: Parsed, final: bool) -> bool:
        """Hand out text up to a marker and open its section (True), or hold a possible marker start."""
        if self.fmt.bare_json and not self.started:
            match = _BARE_START.match(self.buffer, partial=True)
            if match is not None and (match.partial and not final):
                return False
            if match is not None and not match.partial:
                self.marker = ""
                return True
        found = [(self.buffer.find(m), m) for m in self.fmt.markers if m in self.buffer]
        if found:
            at, marker = min(found)
            self._content(out, self.buffer[:at])
            self.marker, self.buffer = marker, self.buffer[at + len(marker):]
            return True
        keep = 0 if final else held_suffix(self.buffer, self.fmt.markers)
        if not self.started and not final and not self.buffer.strip() and self.fmt.bare_json:
            keep = len(self.buffer)  # leading whitespace: a bare call may still follow
        self._content(out, self.buffer[: len(self.buffer) - keep])
        self.buffer = self.buffer[len(self.buffer) - keep:]
        return False

    def _read_section(self, out: Parsed, final: bool) -> bool:
        """Hand out the open section's new call deltas; True when it closed (the rest is text again)."""
        assert self.marker is not None
        size = len(self.buffer)
        if not final and size > LINEAR_FROM and size - self.read_at < size // RE_READ_FRACTION:
            return False
        self.read_at = size
        section = self.fmt.read(self.marker, self.buffer, final, self.tools)
        if section.failed and len(self.calls) == self.section_first:
            self.started = True
            self._content(out, self.marker)
            self.marker = None
            return True
        for i, (name, arguments) in enumerate(section.calls):
            index = self.section_first + i
            if index == len(self.calls):
                self.calls.append(ToolCall(self.fmt.new_id(), name, ""))
                out.calls.append(CallDelta(index, id=self.calls[index].id, name=name))
            call = self.calls[index]
            if len(arguments) > len(call.arguments):
                out.calls.append(CallDelta(index, arguments=arguments[len(call.arguments):]))
                call.arguments = arguments
        if section.end is None and not section.failed:
            if final:
                self.buffer = ""
            return False
        self.buffer = self.buffer[section.end or 0:] if not section.failed else self.buffer
        self.marker, self.section_first, self.started, self.read_at = None, len(self.calls), True, 0
        return True

    def _content(self, out: Parsed, text: str) -> None:
        if text:
            out.content += text
            self.started = self.started or bool(text.strip())
