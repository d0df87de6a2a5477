"""From engine token events to API responses: whole responses, SSE chunks, usage and logprobs."""

from __future__ import annotations

import json
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from pydantic import BaseModel

from mlxformer.engine import TokenEvent
from mlxformer.server.errors import error_body
from mlxformer.server.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse, ChoiceLogprobs,
    CompletionChoice, CompletionTokensDetails, CompletionLogprobs, CompletionResponse, Delta, PromptTokensDetails, TokenLogprob, TopLogprob,
    Usage,
)
from mlxformer.server.reply import Reply, ReplyParser
from mlxformer.server.toolcalls import CallDelta
from mlxformer.tokenizer import Tokenizer


def usage_of(event: TokenEvent | None) -> Usage:
    """Token counts from the last event of a request."""
    if event is None:
        return Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0)
    return Usage(
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
    """The text of single token ids, as OpenAI's logprobs show them."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos = frozenset(tokenizer.eos_token_ids)

    def __call__(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def scored(self, event: TokenEvent) -> bool:
        """Whether ``event`` carries a generated token to report logprobs for (EOS is not reported)."""
        return event.token is not None and event.logprob is not None and event.token not in self.eos


def chat_token_logprob(event: TokenEvent, text: TokenStrings) -> TokenLogprob:
    """One ``logprobs.content`` entry of a chat completion."""
    token = text(event.token)
    top = [
        TopLogprob(token=(t := text(i)), logprob=float(lp), bytes=list(t.encode("utf-8")))
        for i, lp in (event.top_logprobs or [])
    ]
    return TokenLogprob(token=token, logprob=float(event.logprob), bytes=list(token.encode("utf-8")), top_logprobs=top)


@dataclass
class CompletionLogprobBuilder:
    """Accumulates a text completion's ``logprobs`` object (tokens, their logprobs, top maps, offsets)."""

    text: TokenStrings
    offset: int = 0  # text offset of the next token
    logprobs: CompletionLogprobs = field(default_factory=CompletionLogprobs)

    def add(self, event: TokenEvent) -> None:
        token = self.text(event.token)
        self.logprobs.tokens.append(token)
        self.logprobs.token_logprobs.append(float(event.logprob))
        self.logprobs.top_logprobs.append({self.text(i): float(lp) for i, lp in (event.top_logprobs or [])})
        self.logprobs.text_offset.append(self.offset)
        self.offset += len(token)


@dataclass
class Collected:
    """A whole (non-streamed) generation."""

    text: str = ""
    finish_reason: str | None = None
    last: TokenEvent | None = None
    events: list[TokenEvent] = field(default_factory=list)


async def collect(events: AsyncIterator[TokenEvent]) -> Collected:
    """Drain a request's events into one result (closing the iterator whatever happens)."""
    result = Collected()
    pieces: list[str] = []
    async with aclosing(events):
        async for event in events:
            pieces.append(event.text)
            result.events.append(event)
            result.last = event
            if event.finish_reason is not None:
                result.finish_reason = event.finish_reason
    result.text = "".join(pieces)
    return result


def chat_response(request_id: str, model: str, reply: Reply, text: TokenStrings, logprobs: bool
                  ) -> ChatCompletionResponse:
    """The ``chat.completion`` object for a finished reply (content, reasoning and calls)."""
    content = [chat_token_logprob(e, text) for e in reply.events if text.scored(e)] if logprobs else None
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
    return ChatCompletionResponse(id=request_id, model=model, choices=[choice], usage=usage_of(reply.last))


def completion_response(
    request_id: str, model: str, result: Collected, text: TokenStrings, logprobs: bool, echo: str = ""
) -> CompletionResponse:
    """The ``text_completion`` object for a finished generation (``echo``: the prompt text to prepend)."""
    builder = CompletionLogprobBuilder(text, offset=len(echo))
    for event in result.events:
        if logprobs and text.scored(event):
            builder.add(event)
    choice = CompletionChoice(
        text=echo + result.text, logprobs=builder.logprobs if logprobs else None, finish_reason=result.finish_reason
    )
    return CompletionResponse(id=request_id, model=model, choices=[choice], usage=usage_of(result.last))


def sse(payload: BaseModel | dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json(exclude_none=True)
    elif isinstance(payload, dict):
        data = json.dumps(payload)
    else:
        data = payload
    return f"data: {data}\n\n"


ChunkMaker = Callable[[TokenEvent], BaseModel | None]


def chat_chunk_maker(request_id: str, model: str, text: TokenStrings, logprobs: bool, parser: ReplyParser
                     ) -> ChunkMaker:
    """Maps each event to a ``chat.completion.chunk`` of what ``parser`` makes of it (content,
    reasoning, ``tool_calls`` deltas: index, id and name first, then argument fragments), or None
    when it carries nothing to send. Held-back text keeps its logprobs: they ride on the chunk
    of the event that produced them."""

    def make(event: TokenEvent) -> BaseModel | None:
        delta = parser.feed(event)
        entry = [chat_token_logprob(event, text)] if logprobs and text.scored(event) else None
        finish = parser.finish_reason(event.finish_reason)
        if not (delta.content or delta.reasoning or delta.calls) and entry is None and finish is None:
            return None
        calls = [_call_delta(c) for c in delta.calls] or None
        choice = ChatChunkChoice(
            delta=Delta(content=delta.content or None if calls or delta.reasoning else delta.content,
                        reasoning_content=delta.reasoning or None, reasoning=delta.reasoning or None, tool_calls=calls),
            logprobs=ChoiceLogprobs(content=entry) if entry is not None else None,
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


def completion_chunk_maker(request_id: str, model: str, text: TokenStrings, logprobs: bool, echo: str) -> ChunkMaker:
    """Maps each event to a streamed ``text_completion`` object (the first one carries ``echo``)."""
    builder = CompletionLogprobBuilder(text, offset=len(echo))
    pending_echo = [echo]

    def make(event: TokenEvent) -> BaseModel | None:
        scored = logprobs and text.scored(event)
        if scored:
            builder.logprobs = CompletionLogprobs()
            builder.add(event)
        piece = pending_echo.pop() + event.text if pending_echo else event.text
        if not piece and not scored and event.finish_reason is None:
            return None
        choice = CompletionChoice(
            text=piece, logprobs=builder.logprobs if scored else None, finish_reason=event.finish_reason
        )
        return CompletionResponse(id=request_id, model=model, choices=[choice])

    return make


def error_event(message: str) -> str:
    """An SSE error event for a failure after the stream started."""
    return sse(error_body(message, "server_error"))
