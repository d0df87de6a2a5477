"""From engine token events to API responses: whole responses, SSE chunks, usage and logprobs.

Logprobs are always finite JSON numbers: tokens a constraint masked (log-probability −inf) are
left out of the alternatives, and a chosen token's −inf or NaN is reported as OpenAI's floor,
−9999. Every generated token has one entry, whatever text it adds (end-of-sequence adds none,
a stop string's tokens are cut from the text): ``usage.completion_tokens`` entries, as OpenAI's
contract has it and lm-evaluation-harness reads it (``token_logprobs[ctxlen:-1]`` of an echo with
one generated token). While streaming, a token is reported once the text it starts in has been
sent; the last event releases the rest. Token strings and bytes are the token's own bytes.
"""

from __future__ import annotations

import codecs
import json
import math
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from pydantic import BaseModel

from mlxformer.engine import TokenEvent
from mlxformer.server.errors import error_body
from mlxformer.server.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse, ChoiceLogprobs,
    CompletionChoice, CompletionLogprobs, CompletionResponse, CompletionTokensDetails, Delta, PromptTokensDetails,
    TokenLogprob, TopLogprob, Usage,
)
from mlxformer.server.reply import Reply, ReplyParser
from mlxformer.server.toolcalls import CallDelta
from mlxformer.text.tokenizer import Tokenizer

LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token the model gives (next to) no probability
SPECIAL_MARKER = b"\xff"  # the grammar vocabulary's mark on control tokens


def finite(logprob: float) -> float:
    """``logprob`` as a JSON-safe number: −inf and NaN become ``LOGPROB_FLOOR``."""
    return logprob if math.isfinite(logprob) else (0.0 if logprob > 0 else LOGPROB_FLOOR)


def usage_of(event: TokenEvent | None, max_tokens: int | None = None) -> Usage:
    """Token counts from the last event of a request; ``max_tokens``: the reply's, when fewer
    than asked (``Lease.cut``)."""
    if event is None:
        return Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0, max_tokens=max_tokens)
    return Usage(
        max_tokens=max_tokens,
        prompt_tokens=event.prompt_tokens,
        completion_tokens=event.completion_tokens,
        total_tokens=event.prompt_tokens + event.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=event.cached_tokens),
        completion_tokens_details=CompletionTokensDetails(
            accepted_prediction_tokens=event.accepted_tokens,
            rejected_prediction_tokens=event.proposed_tokens - event.accepted_tokens,
        ) if event.proposed_tokens else None,
    )


class TokenStrings:
    """Single tokens as OpenAI's logprobs show them: their own bytes (a byte-fallback token is
    its one byte), and as a string their UTF-8 text, or ``bytes:\\xNN...`` when that is not text."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._vocab: Any = None

    @property
    def vocab(self) -> Any:
        """The grammar engine's vocabulary (token id -> bytes), built once per tokenizer, cached on it."""
        if self._vocab is None:
            from mlxformer.constrained.vocab import grammar_tokenizer

            self._vocab = grammar_tokenizer(self.tokenizer, self.vocab_size)
        return self._vocab

    def bytes_of(self, token: int) -> bytes:
        """The bytes ``token`` stands for (a control token: its name)."""
        data = self.vocab.decode_bytes([token])
        return data[len(SPECIAL_MARKER):] if data.startswith(SPECIAL_MARKER) else data

    def text_bytes(self, token: int) -> bytes:
        """The bytes ``token`` adds to the text: none for a control token (BOS adds no text)."""
        return b"" if self.vocab.is_special_token(token) else self.bytes_of(token)

    def __call__(self, token: int) -> str:
        data = self.bytes_of(token)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    @staticmethod
    def scored(event: TokenEvent) -> bool:
        """Whether ``event`` carries a generated token to report logprobs for (EOS included)."""
        return event.token is not None and event.logprob is not None


@dataclass
class Scored:
    """A generated token to report: its event and where its text starts (characters into the output)."""

    event: TokenEvent
    offset: int


class LogprobAligner:
    """Releases each scored token once the output text sent so far reaches into it, and every
    token still held at the end (one adding no text, like EOS; one past a stop-string cut)."""

    def __init__(self, text: TokenStrings) -> None:
        self.text = text
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0  # characters the scored tokens' bytes make so far
        self.sent = 0  # characters of output text so far
        self.pending: list[Scored] = []

    def add(self, event: TokenEvent) -> list[Scored]:
        """Feed one event; returns the tokens now due."""
        if self.text.scored(event):
            self.pending.append(Scored(event, self.chars))
            self.chars += len(self.decoder.decode(self.text.text_bytes(event.token)))  # type: ignore[arg-type]
        self.sent += len(event.text)
        if event.finish_reason is not None:
            due, self.pending = self.pending, []
            return due
        due = [s for s in self.pending if s.offset < self.sent]
        self.pending = self.pending[len(due):]
        return due


def top_alternatives(event: TokenEvent) -> list[tuple[int, float]]:
    """The event's alternatives with a finite log-probability (masked tokens left out)."""
    return [(i, lp) for i, lp in (event.top_logprobs or []) if math.isfinite(lp)]


def chat_token_logprob(event: TokenEvent, text: TokenStrings) -> TokenLogprob:
    """One ``logprobs.content`` entry of a chat completion."""
    assert event.token is not None and event.logprob is not None
    top = [TopLogprob(token=text(i), logprob=lp, bytes=list(text.bytes_of(i))) for i, lp in top_alternatives(event)]
    return TokenLogprob(token=text(event.token), logprob=finite(event.logprob),
                        bytes=list(text.bytes_of(event.token)), top_logprobs=top)


def echo_logprobs(
    ids: list[int], entries: list[tuple[float, list[tuple[int, float]]]], text: TokenStrings, echo: str
) -> CompletionLogprobs:
    """A text completion's ``logprobs`` for its echoed prompt ``ids``: the first token has none
    (``null``, as OpenAI reports it), each later one its log-probability given those before it.
    ``text_offset`` indexes ``echo``, the echoed text: a control token written in it (``<|im_start|>``)
    spans its name there, one the tokenizer added (a BOS) nothing."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, chars = [], 0
    for token in ids:
        offsets.append(chars)
        if text.vocab.is_special_token(token):
            name = text(token)
            chars += len(name) if echo.startswith(name, chars) else 0
        else:
            chars += len(decoder.decode(text.text_bytes(token)))
    top = [{text(i): lp for i, lp in alternatives if math.isfinite(lp)} for _, alternatives in entries]
    return CompletionLogprobs(
        tokens=[text(i) for i in ids], token_logprobs=[None, *(finite(lp) for lp, _ in entries)],
        top_logprobs=[None, *top], text_offset=offsets,
    )


def add_completion_logprob(logprobs: CompletionLogprobs, scored: Scored, text: TokenStrings, base: int) -> None:
    """Append one generated token to a text completion's ``logprobs`` (``base``: the echo's length)."""
    event = scored.event
    assert event.token is not None and event.logprob is not None
    logprobs.tokens.append(text(event.token))
    logprobs.token_logprobs.append(finite(event.logprob))
    logprobs.top_logprobs.append({text(i): lp for i, lp in top_alternatives(event)})
    logprobs.text_offset.append(base + scored.offset)


@dataclass
class Collected:
    """A whole (non-streamed) generation."""

    text: str = ""
    finish_reason: str | None = None
    last: TokenEvent | None = None
    events: list[TokenEvent] = field(default_factory=list)
    max_tokens: int | None = None  # the reply's max tokens when fewer than asked (``Lease.cut``)
    first_ns: int | None = None  # ``time.monotonic_ns()`` when the first event arrived (the prompt's end)

    def scored(self, text: TokenStrings) -> list[Scored]:
        """The tokens to report logprobs for: every generated one."""
        aligner = LogprobAligner(text)
        return [s for event in self.events for s in aligner.add(event)]


async def collect(events: AsyncIterator[TokenEvent]) -> Collected:
    """Drain a request's events into one result (closing the iterator whatever happens)."""
    result = Collected()
    pieces: list[str] = []
    async with aclosing(events):
        async for event in events:
            result.first_ns = result.first_ns or time.monotonic_ns()
            pieces.append(event.text)
            result.events.append(event)
            result.last = event
            if event.finish_reason is not None:
                result.finish_reason = event.reported_finish_reason
    result.text = "".join(pieces)
    return result


def chat_response(request_id: str, model: str, result: Collected, reply: Reply, text: TokenStrings, logprobs: bool
                  ) -> ChatCompletionResponse:
    """The ``chat.completion`` object for a finished generation, as ``reply`` reads it (content,
    reasoning and calls)."""
    content = [chat_token_logprob(s.event, text) for s in result.scored(text)] if logprobs else None
    message = AssistantMessage(
        content=reply.content if reply.content or not reply.calls else None,
        reasoning_content=reply.reasoning or None, reasoning=reply.reasoning or None,
        tool_calls=[call.to_openai() for call in reply.calls] or None,
    )
    choice = ChatChoice(
        message=message,
        logprobs=ChoiceLogprobs(content=content) if logprobs else None,
        finish_reason=reply.finish_reason,
    )
    usage = usage_of(result.last, result.max_tokens)
    return ChatCompletionResponse(id=request_id, model=model, choices=[choice], usage=usage)


def completion_response(
    request_id: str, model: str, result: Collected, text: TokenStrings, logprobs: bool, echo: str = "",
    prompt_logprobs: CompletionLogprobs | None = None,
) -> CompletionResponse:
    """The ``text_completion`` object for a finished generation (``echo``: the prompt text to
    prepend; ``prompt_logprobs``: its tokens' entries, which come first)."""
    built = prompt_logprobs.model_copy(deep=True) if prompt_logprobs is not None else CompletionLogprobs()
    for scored in result.scored(text) if logprobs else []:
        add_completion_logprob(built, scored, text, len(echo))
    choice = CompletionChoice(
        text=echo + result.text, logprobs=built if logprobs else None, finish_reason=result.finish_reason
    )
    usage = usage_of(result.last, result.max_tokens)
    return CompletionResponse(id=request_id, model=model, choices=[choice], usage=usage)


def chunk_json(payload: BaseModel, include_usage: bool) -> str:
    """A streamed object as OpenAI sends it: ``finish_reason`` and ``logprobs`` always present
    (``null`` until set), ``usage: null`` on every chunk when usage was asked for (else absent),
    and a delta carrying only what it sets."""
    data = payload.model_dump()
    for choice in data.get("choices", []):
        if isinstance(choice.get("delta"), dict):
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    if data.get("usage") is None and not include_usage:
        data.pop("usage", None)
    return json.dumps(data, allow_nan=False, separators=(",", ":"), ensure_ascii=False)


def sse(payload: BaseModel | dict[str, Any] | str, include_usage: bool = False) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    if isinstance(payload, BaseModel):
        data = chunk_json(payload, include_usage)
    elif isinstance(payload, dict):
        data = json.dumps(payload, allow_nan=False)
    else:
        data = payload
    return f"data: {data}\n\n"


ChunkMaker = Callable[[TokenEvent], BaseModel | None]


def chat_chunk_maker(request_id: str, model: str, text: TokenStrings, logprobs: bool, parser: ReplyParser
                     ) -> ChunkMaker:
    """Maps each event to a ``chat.completion.chunk`` of what ``parser`` makes of it (content,
    reasoning, ``tool_calls`` deltas: index, id and name first, then argument fragments), or None
    when it carries nothing to send. Logprobs are reported as the engine's text reaches each
    token, also while the parser holds that text back."""
    aligner = LogprobAligner(text)

    def make(event: TokenEvent) -> BaseModel | None:
        due = aligner.add(event)
        delta = parser.feed(event)
        entries = [chat_token_logprob(s.event, text) for s in due] if logprobs and due else None
        finish = parser.finish_reason(event.reported_finish_reason)
        if not (delta.content or delta.reasoning or delta.calls) and entries is None and finish is None:
            return None
        calls = [_call_delta(c) for c in delta.calls] or None
        content = (delta.content or None) if calls or delta.reasoning else delta.content
        choice = ChatChunkChoice(
            delta=Delta(content=content, reasoning_content=delta.reasoning or None, reasoning=delta.reasoning or None,
                        tool_calls=calls),
            logprobs=ChoiceLogprobs(content=entries) if entries is not None else None,
            finish_reason=finish,
        )
        return ChatCompletionChunk(id=request_id, model=model, choices=[choice])

    return make


def _call_delta(delta: CallDelta) -> dict[str, Any]:
    """One ``delta.tool_calls`` entry."""
    if delta.id is not None:
        return {"index": delta.index, "id": delta.id, "type": "function",
                "function": {"name": delta.name, "arguments": delta.arguments}}
    return {"index": delta.index, "function": {"arguments": delta.arguments}}


def completion_chunk_maker(
    request_id: str, model: str, text: TokenStrings, logprobs: bool, echo: str,
    prompt_logprobs: Callable[[], CompletionLogprobs | None] = lambda: None,
) -> ChunkMaker:
    """Maps each event to a streamed ``text_completion`` object (the first one carries ``echo``
    and the prompt's logprobs, ready once the first event came)."""
    aligner = LogprobAligner(text)
    pending_echo = [echo]

    def make(event: TokenEvent) -> BaseModel | None:
        piece, built = event.text, None
        if pending_echo:
            piece, built = pending_echo.pop() + piece, prompt_logprobs()
        due = aligner.add(event) if logprobs else []
        if due:
            built = built or CompletionLogprobs()
            for scored in due:
                add_completion_logprob(built, scored, text, len(echo))
        if not piece and built is None and event.finish_reason is None:
            return None
        choice = CompletionChoice(text=piece, logprobs=built, finish_reason=event.reported_finish_reason)
        return CompletionResponse(id=request_id, model=model, choices=[choice])

    return make


def error_event(message: str) -> str:
    """An SSE error event for a failure after the stream started."""
    return sse(error_body(message, "server_error"))
