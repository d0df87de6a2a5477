"""Stop strings over streamed text: emit only what can no longer become part of a stop string."""

from __future__ import annotations

from typing import Sequence


class StopMatcher:
    """Feed text pieces; get back the safe-to-emit prefix and whether a stop string was hit."""

    def __init__(self, stop: Sequence[str]):
        self.stop = [s for s in stop if s]
        self.pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """Returns ``(text to emit, stopped)``; on a stop the text ends just before the stop string."""
        self.pending += piece
        if not self.stop:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        keep = self._held_suffix_length()
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def _held_suffix_length(self) -> int:
        """Length of the longest suffix of the pending text that begins some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def flush(self) -> str:
        """Everything still held back (at the end of generation)."""
        out, self.pending = self.pending, ""
        return out
