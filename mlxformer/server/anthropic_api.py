"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: the Anthropic Messages API as a thin
translator (request -> ``Turn``; reply segments -> content blocks, or Anthropic's event stream).
Errors on these routes are Anthropic-shaped (see ``anthropic_protocol.anthropic_error``)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from mlxformer.engine import TokenEvent
from mlxformer.server.anthropic_protocol import (
    AnthropicErrorResponse, ContentBlock, Message, MessageResponse, MessagesRequest, MessageStreamEvent, TokenCount,
    TokenCountRequest, anthropic_error,
)
from mlxformer.server.errors import bad_request, validation_message
from mlxformer.server.context import ServerContext
from mlxformer.server.hosting import check_model
from mlxformer.server.sse import frames, named_event
from mlxformer.server.openapi import BODY, GENERATION, GUARDED, KEYED, error_responses, streamed_ok
from mlxformer.server.streaming import collect_unless_gone
from mlxformer.server.protocol import ResponseFormat, SamplingFields, new_id
from mlxformer.server.segments import ReplySegment, SegmentEvent, Segmenter
from mlxformer.server.turn import Turn, effort_budget, prepare, render_prompt
from mlxformer.server.tools import tool_plan

PATH_PREFIX = "/v1/messages"
PING_EVENT = named_event({"type": "ping"})  # Anthropic's keep-alive: an event, which clients' idle timers count
BLOCK_TYPES = {"reasoning": "thinking", "text": "text", "call": "tool_use"}
# every error of these routes, the guard's and the key's too, is Anthropic-shaped
COUNT_ERRORS = error_responses((*GUARDED, *KEYED, *BODY, 404, 415), AnthropicErrorResponse)
MESSAGE_ERRORS = error_responses((*GUARDED, *KEYED, *GENERATION), AnthropicErrorResponse)


def is_anthropic_path(path: str) -> bool:
    """Whether a request path is one of this API's (its errors are Anthropic-shaped)."""
    return path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/")


# Claude Code's first system block: client metadata for Anthropic's billing (its ``cch=`` hash
# changes per request), not text for the model; kept out of the prompt so turns share a prefix
BILLING_HEADER = "x-anthropic-billing-header:"


def system_text(system: str | list[ContentBlock]) -> str:
    """A system prompt's text, without Claude Code's billing-header block."""
    if isinstance(system, str):
        return system
    return "".join(b.plain() for b in system if not (b.type == "text" and (b.text or "").startswith(BILLING_HEADER)))


def conversation(system: str | list[ContentBlock] | None, messages: list[Message]) -> tuple[list[dict[str, Any]], str]:
    """Anthropic messages as OpenAI-style chat messages (tool results become ``tool`` turns,
    ``tool_use`` blocks the assistant's ``tool_calls``, ``thinking`` its ``reasoning_content``;
    system messages stay where they stand), and the assistant prefill: the text of a last
    assistant message, which the reply continues."""
    out: list[dict[str, Any]] = []
    if system and (text := system_text(system)):
        out.append({"role": "system", "content": text})
    for m in messages:
        if m.role == "system":
            if text := system_text(m.content):
                out.append({"role": "system", "content": text})
            continue
        texts, calls, thoughts = [], [], []
        for block in m.blocks():
            if block.type in ("image", "document"):
                raise bad_request(f"{block.type} blocks are not supported: this server serves a text model", "messages")
            if block.type == "tool_result":
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.plain()})
            elif block.type == "tool_use":
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": block.input or {}}})
            elif block.type == "thinking":
                thoughts.append(block.thinking or "")
            elif block.type == "text":
                texts.append(block.text or "")
        if texts or calls or thoughts:
            message: dict[str, Any] = {"role": m.role, "content": "".join(texts)}
            if calls:
                message["tool_calls"] = calls
            if thoughts:
                message["reasoning_content"] = "".join(thoughts)
            out.append(message)
    last = out[-1] if out else None
    if last is not None and messages[-1].role == "assistant" and last["role"] == "assistant" and "tool_calls" not in last:
        out.pop()
        return out, last["content"]
    return out, ""


def anthropic_turn(body: TokenCountRequest) -> Turn:
    """The turn a Messages (or token count) request asks for."""
    tools = None
    if body.tools:
        if bad := [t.name for t in body.tools if t.type not in (None, "custom")]:
            raise bad_request(f"server tools are not supported (tool {bad[0]!r})", param="tools")
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.input_schema}} for t in body.tools]
    choice: str | dict[str, Any] | None = None
    if body.tool_choice is not None:
        kind = body.tool_choice.type
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or {
            "type": "function", "function": {"name": body.tool_choice.name}}
    thinking, budget, response_format, effort = None, None, None, None
    if body.thinking is not None:
        thinking = body.thinking.type != "disabled"
        budget = body.thinking.budget_tokens if body.thinking.type == "enabled" else None
    if (config := body.output_config) is not None:
        if config.effort is not None:
            effort = {"xhigh": "high", "max": "high"}.get(config.effort, config.effort)
        if budget is None and effort is not None:
            budget = effort_budget(effort)
        if config.format is not None:
            response_format = ResponseFormat(type="json_schema", json_schema={"name": "output", "schema": config.format.schema_})
    full = body if isinstance(body, MessagesRequest) else None
    try:
        fields = SamplingFields(
            model=body.model, temperature=full.temperature if full else None, top_p=full.top_p if full else None,
            top_k=full.top_k if full else None, stop=full.stop_sequences if full else None,
        )
    except ValidationError as exc:
        raise bad_request(*validation_message(list(exc.errors()))) from exc
    messages, prefill = conversation(body.system, body.messages)
    # max_tokens is checked against the context by the route (clamped, or refused in Anthropic's words)
    return Turn(messages=messages, fields=fields, tools=tools, tool_choice=choice, response_format=response_format,
                thinking=thinking, reasoning_budget=budget, effort=effort, prefill=prefill)


def context_limit(prompt_tokens: int, room: int, requested: int, strict: bool) -> int:
    """The max tokens of a reply asked for ``requested`` with ``room`` tokens left in the context
    after the prompt: ``requested`` when it fits, else ``room`` (or, ``strict``, a 400 in
    Anthropic's wording, which clients such as Claude Code retry with a smaller ``max_tokens``)."""
    if requested <= room:
        return requested
    if strict:
        context = prompt_tokens + room
        raise bad_request(f"input length and `max_tokens` exceed context limit: {prompt_tokens} + {requested} > "
                          f"{context}, decrease input length or `max_tokens` and try again", param="max_tokens")
    return room


def usage(event: TokenEvent | None) -> dict[str, int]:
    prompt, cached = (event.prompt_tokens, event.cached_tokens) if event else (0, 0)
    return {"input_tokens": prompt - cached, "output_tokens": event.completion_tokens if event else 0,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def stop_reason(event: TokenEvent, called: bool, text: str, stops: list[str], eos: frozenset[int]
                ) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of a finished reply (``text``: its tokens decoded, a stop
    sequence the engine cut off the reply still in)."""
    if event.truncated:
        return "max_tokens", None
    if called:
        return "tool_use", None
    if stops and event.token is not None and event.token not in eos:
        hit = [s for s in stops if s in text]
        if hit:
            return "stop_sequence", min(hit, key=text.find)
    return "end_turn", None


def block_start(segment: ReplySegment) -> dict[str, Any]:
    if segment.kind == "call":
        return {"type": "tool_use", "id": segment.call_id, "name": segment.name, "input": {}}
    if segment.kind == "reasoning":
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "text", "text": ""}


def block_delta(segment: ReplySegment, piece: str) -> dict[str, Any]:
    if segment.kind == "call":
        return {"type": "input_json_delta", "partial_json": piece}
    if segment.kind == "reasoning":
        return {"type": "thinking_delta", "thinking": piece}
    return {"type": "text_delta", "text": piece}


def whole_block(segment: ReplySegment) -> dict[str, Any]:
    if segment.kind == "call":
        try:
            arguments = json.loads(segment.text) if segment.text.strip() else {}
        except json.JSONDecodeError:
            arguments = {}
        return {"type": "tool_use", "id": segment.call_id, "name": segment.name,
                "input": arguments if isinstance(arguments, dict) else {}}
    if segment.kind == "reasoning":
        return {"type": "thinking", "thinking": segment.text, "signature": ""}
    return {"type": "text", "text": segment.text}


def messages_router(ctx: ServerContext) -> APIRouter:
    """The Messages routes (mounted under the app's authenticated ``/v1``)."""
    router = APIRouter()
    served = ctx.served
    eos = frozenset(served.tokenizer.eos_token_ids)

    @router.post("/messages/count_tokens", response_model=TokenCount, responses=COUNT_ERRORS)
    async def count_tokens(body: TokenCountRequest) -> dict[str, int]:
        check_model(ctx, body.model)
        def count() -> int:
            turn = anthropic_turn(body)
            text = render_prompt(turn, served, tool_plan(turn.tools, turn.tool_choice), ctx.traits)
            return len(served.tokenizer.encode(text, add_special_tokens=False))

        return {"input_tokens": await ctx.prepare(count)}

    @router.post("/messages", response_model=MessageResponse,
                 responses={**streamed_ok(MessageResponse, MessageStreamEvent), **MESSAGE_ERRORS})
    async def messages(body: MessagesRequest, request: Request) -> Response:
        check_model(ctx, body.model)
        prepared = await ctx.prepare(lambda: prepare(anthropic_turn(body), served, ctx.traits))
        prompt_tokens = len(prepared.request.prompt_ids)
        limit = context_limit(prompt_tokens, prepared.request.max_tokens, body.max_tokens, ctx.strict_max_tokens)
        prepared.request.max_tokens = limit  # the engine may cut it further, to what the KV budget holds
        lease = ctx.submit(prepared.request, "messages", asked=body.max_tokens)
        parser, segmenter = prepared.parser(), Segmenter()
        message_id, stops = new_id("msg").replace("-", "_"), body.stop_sequences or []
        head = {"id": message_id, "type": "message", "role": "assistant", "model": body.model}
        generated: list[int] = []  # token ids: the text without a stop sequence cut off

        def finish(event: TokenEvent) -> tuple[str, str | None]:
            text = served.tokenizer.decode(generated) if stops else ""
            return stop_reason(event, bool(parser.calls), text, stops, eos)

        def usage_of(event: TokenEvent | None) -> dict[str, int]:
            return {**usage(event), **({"max_tokens": lease.cut} if lease.cut is not None else {})}

        if body.stream:
            # message_start as soon as the request is admitted: the prompt's cached part is not known yet
            start = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                     "usage": {**usage(None), "input_tokens": prompt_tokens}}
            opening = [named_event({"type": "message_start", "message": start}), PING_EVENT]

            def on_event(event: TokenEvent) -> list[str]:
                generated.extend([event.token] if event.token is not None else [])
                out = [named_event(frame) for frame in block_events(segmenter.feed(parser.feed(event)))]
                if event.finish_reason is not None:
                    reason, sequence = finish(event)
                    out.append(named_event({"type": "message_delta", "usage": usage_of(event),
                                          "delta": {"stop_reason": reason, "stop_sequence": sequence}}))
                    out.append(named_event({"type": "message_stop"}))
                return out

            def on_error(message: str) -> list[str]:
                return [named_event(anthropic_error(500, message))]

            return ctx.event_stream(frames(lease, on_event, on_error, opening), lease, ping=PING_EVENT)
        result = await collect_unless_gone(lease, request)
        for event in result.events:
            generated.extend([event.token] if event.token is not None else [])
            segmenter.feed(parser.feed(event))
        reason, sequence = finish(result.events[-1]) if result.events else ("end_turn", None)
        content = [whole_block(s) for s in segmenter.segments]
        return JSONResponse({**head, "content": content, "stop_reason": reason, "stop_sequence": sequence,
                             "usage": usage_of(result.last)}, headers=lease.headers)

    return router


def block_events(events: list[SegmentEvent]) -> list[dict[str, Any]]:
    """Anthropic ``content_block_*`` events of segment events."""
    out: list[dict[str, Any]] = []
    for e in events:
        if e.action == "open":
            out.append({"type": "content_block_start", "index": e.segment.index, "content_block": block_start(e.segment)})
        elif e.action == "delta":
            out.append({"type": "content_block_delta", "index": e.segment.index, "delta": block_delta(e.segment, e.piece)})
        else:
            out.append({"type": "content_block_stop", "index": e.segment.index})
    return out
