"""Incremental detokenization: turn a stream of token ids into text pieces.

Only a bounded window of recent tokens is decoded per step. Text is emitted once it is final:
a trailing U+FFFD may be an incomplete UTF-8 character that the next token completes, so up
to three of them are held back; tokens flagged by `holds` (byte-fallback `<0xNN>` tokens, which
the decoder joins into one group) are held until the group ends.

Invariant: `"".join(pieces) + finalize() == decode(all_tokens)`.
"""

from collections.abc import Callable

REPLACEMENT = "\ufffd"
MAX_HELD_REPLACEMENTS = 3  # an incomplete UTF-8 character has at most 3 bytes
CONTEXT_TOKENS = 8  # tokens kept before a forced re-anchor
MAX_WINDOW = 32  # re-anchor (if safe) once the window grows past this


class StreamingDetokenizer:
    """Streams text for tokens added one at a time; `decode` is the tokenizer's full decode."""

    def __init__(self, decode: Callable[[list[int]], str], holds: Callable[[int], bool] | None = None) -> None:
        self._decode = decode
        self._holds = holds
        self.tokens: list[int] = []
        self._pieces: list[str] = []
        self._start = 0  # first token of the decode window
        self._emitted = 0  # characters of decode(tokens[_start:]) already emitted

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def add_token(self, token: int) -> str:
        """Add one token id; return the newly completed text (possibly "")."""
        self.tokens.append(int(token))
        if self._holds is not None and self._holds(token):
            return ""
        window_text = self._decode(self.tokens[self._start :])
        end = len(window_text)
        held = 0
        while held < MAX_HELD_REPLACEMENTS and end > self._emitted and window_text[end - 1] == REPLACEMENT:
            end -= 1
            held += 1
        piece = window_text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        if piece:
            self._pieces.append(piece)
        self._reanchor(window_text)
        return piece

    def finalize(self) -> str:
        """Flush and return whatever text is still held back."""
        window_text = self._decode(self.tokens[self._start :])
        piece = window_text[self._emitted :]
        self._start, self._emitted = len(self.tokens), 0
        if piece:
            self._pieces.append(piece)
        return piece

    def _reanchor(self, window_text: str) -> None:
        """Shrink the window so each step decodes O(1) tokens."""
        n = len(self.tokens)
        if self._emitted == len(window_text):
            # Everything is final: keep the last token as context, unless it is blank (decoders
            # may strip leading whitespace at the start of the text, e.g. sentencepiece).
            last = self._decode(self.tokens[n - 1 :])
            if last and not last.isspace():
                self._start, self._emitted = n - 1, len(last)
                return
        if n - self._start <= MAX_WINDOW:
            return
        # Held text at the end for a long time (undecodable bytes): move the window start forward
        # only where decoding splits cleanly, i.e. decode(a + b) == decode(a) + decode(b).
        cut = n - CONTEXT_TOKENS
        head = self._decode(self.tokens[self._start : cut])
        tail = self._decode(self.tokens[cut:])
        if head + tail == window_text and len(head) <= self._emitted:
            self._start = cut
            self._emitted -= len(head)
