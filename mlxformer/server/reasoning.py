"""Reasoning (``<think>...</think>``; Mistral's ``[THINK]...[/THINK]``, Gemma 4's thought
channel): which models reason, splitting a reply into reasoning and answer as it streams, and a
constraint that leaves the reasoning free (within a token budget, after which ``</think>`` is
forced) and applies the request's own constraint to the answer only.

A prompt that ends inside an open ``<think>`` (DeepSeek-R1 distills' templates open it) starts
the reply in reasoning; otherwise a reply may open it first thing (Qwen3, QwQ).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from mlxformer.sampling.samplers import TokenConstraint
from mlxformer.server.toolcalls.stream import held_suffix
from mlxformer.text.tokenizer import Tokenizer

@dataclass(frozen=True)
class ThinkTags:
    """The texts that open and close a reply's reasoning."""

    open: str
    close: str

    @property
    def closing_text(self) -> str:
        """What is forced when the reasoning budget is spent."""
        return "\n" + self.close + "\n\n"


THINK = ThinkTags("<think>", "</think>")
MISTRAL_THINK = ThinkTags("[THINK]", "[/THINK]")  # Magistral, Ministral 3 Reasoning
GEMMA4_THINK = ThinkTags("<|channel>thought", "<channel|>")  # Gemma 4's thought channel
OPEN, CLOSE = THINK.open, THINK.close
CLOSING_TEXT = THINK.closing_text
EFFORT_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096, "high": None}  # reasoning_effort -> tokens


def think_tags(tokenizer: Tokenizer) -> ThinkTags:
    """The reasoning tags the model's template (or vocabulary) uses: Mistral's or ``<think>``."""
    template = tokenizer.chat_template or ""
    if MISTRAL_THINK.close in template or (THINK.close not in template and tokenizer.token_to_id(MISTRAL_THINK.close)):
        return MISTRAL_THINK
    if GEMMA4_THINK.close in template:
        return GEMMA4_THINK
    return THINK


def reasons(tokenizer: Tokenizer) -> bool:
    """Whether the model writes reasoning: its template mentions the closing tag, or the
    vocabulary has both tags as tokens."""
    tags = think_tags(tokenizer)
    if tags.close in (tokenizer.chat_template or ""):
        return True
    return tokenizer.token_to_id(tags.open) is not None and tokenizer.token_to_id(tags.close) is not None


def starts_in_reasoning(prompt_text: str, tags: ThinkTags = THINK) -> bool:
    """Whether the rendered prompt leaves reasoning open (the reply then begins as reasoning)."""
    return prompt_text.rfind(tags.open) > prompt_text.rfind(tags.close)


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


class ThinkSplitter:
    """Splits streamed text into reasoning and content, holding back only a possible tag start
    (and the whitespace right after ``</think>``)."""

    def __init__(self, in_reasoning: bool, tags: ThinkTags = THINK) -> None:
        self.state = "reasoning" if in_reasoning else "start"
        self.buffer = ""
        self.tags = tags

    def feed(self, text: str, final: bool = False) -> Split:
        """The reasoning and content ``text`` completes (``final``: nothing is held back)."""
        self.buffer += text
        out = Split()
        tags = self.tags
        while True:
            if self.state == "start":
                head = self.buffer.lstrip()
                if head.startswith(tags.open):
                    self.state, self.buffer = "reasoning", head[len(tags.open):]
                    continue
                if not final and tags.open.startswith(head):
                    return out
                self.state = "content"
            if self.state == "reasoning":
                at = self.buffer.find(tags.close)
                if at >= 0:
                    out.reasoning += self.buffer[:at]
                    self.state, self.buffer = "after", self.buffer[at + len(tags.close):]
                    continue
                keep = 0 if final else held_suffix(self.buffer, (tags.close,))
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
                 budget: int | None, close: str = CLOSE) -> None:
        self.inner, self.vocab_size, self.close_ids, self.decode = inner, vocab_size, close_ids, decode
        self.close = close
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
            if self.close in self.decode(self.recent):
                self.state = "answer"
            elif self.budget is not None and self.spent >= self.budget:
                self.state = "closing"

    @property
    def done(self) -> bool:
        return self.state == "answer" and self.inner is not None and self.inner.done


def answer_constraint(inner: TokenConstraint | None, tokenizer: Tokenizer, vocab_size: int, *,
                      in_reasoning: bool, budget: int | None, tags: ThinkTags = THINK) -> TokenConstraint | None:
    """``inner`` for the answer of a reasoning model's reply, with the reasoning ``budget``
    (``None`` when nothing needs constraining)."""
    if inner is None and budget is None:
        return None
    open_id = tokenizer.token_to_id(tags.open)
    return AnswerConstraint(
        inner, vocab_size, tokenizer.encode(tags.closing_text, add_special_tokens=False), tokenizer.decode,
        in_reasoning=in_reasoning, open_id=open_id, budget=budget, close=tags.close,
    )
