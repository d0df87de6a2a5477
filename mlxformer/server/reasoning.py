"""Reasoning (``<think>...</think>``): which models reason, splitting a reply into reasoning and
answer as it streams, and a constraint that leaves the reasoning free (within a token budget,
after which ``</think>`` is forced) and applies the request's own constraint to the answer only.

A prompt that ends inside an open ``<think>`` (DeepSeek-R1 distills' templates open it) starts
the reply in reasoning; otherwise a reply may open it first thing (Qwen3, QwQ).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from mlxformer.sampling import TokenConstraint
from mlxformer.server.toolcalls.stream import held_suffix
from mlxformer.tokenizer import Tokenizer

OPEN, CLOSE = "<think>", "</think>"
CLOSING_TEXT = "\n" + CLOSE + "\n\n"  # forced when the budget is spent
EFFORT_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096, "high": None}  # reasoning_effort -> tokens


def reasons(tokenizer: Tokenizer) -> bool:
    """Whether the model writes ``<think>`` reasoning: its template mentions it, or the
    vocabulary has ``<think>`` and ``</think>`` tokens."""
    template = tokenizer.chat_template or ""
    if CLOSE in template:
        return True
    return tokenizer.token_to_id(OPEN) is not None and tokenizer.token_to_id(CLOSE) is not None


def starts_in_reasoning(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves a ``<think>`` open (the reply then begins as reasoning)."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


class ThinkSplitter:
    """Splits streamed text into reasoning and content, holding back only a possible tag start
    (and the whitespace right after ``</think>``)."""

    def __init__(self, in_reasoning: bool) -> None:
        self.state = "reasoning" if in_reasoning else "start"
        self.buffer = ""

    def feed(self, text: str, final: bool = False) -> Split:
        """The reasoning and content ``text`` completes (``final``: nothing is held back)."""
        self.buffer += text
        out = Split()
        while True:
            if self.state == "start":
                head = self.buffer.lstrip()
                if head.startswith(OPEN):
                    self.state, self.buffer = "reasoning", head[len(OPEN):]
                    continue
                if not final and OPEN.startswith(head):
                    return out
                self.state = "content"
            if self.state == "reasoning":
                at = self.buffer.find(CLOSE)
                if at >= 0:
                    out.reasoning += self.buffer[:at]
                    self.state, self.buffer = "after", self.buffer[at + len(CLOSE):]
                    continue
                keep = 0 if final else held_suffix(self.buffer, (CLOSE,))
                out.reasoning += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return out
            if self.state == "after":
                stripped = self.buffer.lstrip()
                if not stripped and not final:
                    return out
                self.state, self.buffer = "content", stripped
            out.content += self.buffer
            self.buffer = ""
            return out


class AnswerConstraint:
    """A ``TokenConstraint``: free while reasoning (``budget`` tokens at most, then ``</think>``
    is forced token by token), ``inner`` (if any) for the answer.

    ``open_id``: the single-token ``<think>``, allowed as the first token (besides what ``inner``
    allows) when the reply may open reasoning."""

    def __init__(self, inner: TokenConstraint | None, vocab_size: int, close_ids: list[int],
                 decode: Callable[[list[int]], str], *, in_reasoning: bool, open_id: int | None,
                 budget: int | None) -> None:
        self.inner, self.vocab_size, self.close_ids, self.decode = inner, vocab_size, close_ids, decode
        self.budget, self.open_id = budget, open_id
        self.state = "reasoning" if in_reasoning else ("start" if open_id is not None else "answer")
        self.spent, self.recent, self.forced = 0, [], 0
        if self.state == "reasoning" and budget is not None and budget <= 0:
            self.state = "closing"

    def _one(self, tokens: list[int]) -> mx.array:
        allowed = np.zeros((self.vocab_size,), np.bool_)
        allowed[tokens] = True
        return mx.array(allowed)

    def next_mask(self) -> mx.array | None:
        """The tokens allowed next (``None``: any)."""
        if self.state == "reasoning":
            return None
        if self.state == "closing":
            return self._one([self.close_ids[self.forced]])
        inner = self.inner.next_mask() if self.inner is not None else None
        if self.state == "start" and inner is not None:
            return mx.logical_or(inner[: self.vocab_size], self._one([self.open_id]))
        return inner

    def advance(self, token: int) -> None:
        """Record the generated ``token``."""
        if self.state == "start":
            if token == self.open_id:
                self.state = "reasoning" if self.budget is None or self.budget > 0 else "closing"
                return
            self.state = "answer"
        if self.state == "answer":
            if self.inner is not None:
                self.inner.advance(token)
        elif self.state == "closing":
            self.forced += 1
            if self.forced == len(self.close_ids):
                self.state = "answer"
        else:
            self.spent += 1
            self.recent = (self.recent + [token])[-8:]
            if CLOSE in self.decode(self.recent):
                self.state = "answer"
            elif self.budget is not None and self.spent >= self.budget:
                self.state = "closing"

    @property
    def done(self) -> bool:
        return self.state == "answer" and self.inner is not None and self.inner.done


def answer_constraint(inner: TokenConstraint | None, tokenizer: Tokenizer, vocab_size: int, *,
                      in_reasoning: bool, budget: int | None) -> TokenConstraint | None:
    """``inner`` for the answer of a reasoning model's reply, with the reasoning ``budget``
    (``None`` when nothing needs constraining)."""
    if inner is None and budget is None:
        return None
    open_id = tokenizer.token_to_id(OPEN)
    return AnswerConstraint(
        inner, vocab_size, tokenizer.encode(CLOSING_TEXT, add_special_tokens=False), tokenizer.decode,
        in_reasoning=in_reasoning, open_id=open_id, budget=budget,
    )
