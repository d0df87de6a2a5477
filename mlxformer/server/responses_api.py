"""``POST /v1/responses``: the OpenAI Responses API as a thin translator (input items ->
``Turn``; reply segments -> output items, or the documented event stream), stateless, or
continuing a stored response (``previous_response_id``, a bounded in-memory store)."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from mlxformer.engine import TokenEvent
from mlxformer.server.errors import APIError, bad_request, validation_message
from mlxformer.server.context import ServerContext
from mlxformer.server.hosting import check_model, frames, named_event
from mlxformer.server.openapi import GENERATION, error_responses, streamed_ok
from mlxformer.server.streaming import collect_unless_gone
from mlxformer.server.protocol import ResponseFormat, SamplingFields, new_id
from mlxformer.server.responses_protocol import InputItem, ResponseObject, ResponsesRequest, ResponseStreamEvent
from mlxformer.server.segments import Segment, SegmentEvent, Segmenter
from mlxformer.server.turn import Turn, effort_budget, prepare

STORE_LIMIT = 256  # responses kept for previous_response_id (oldest dropped first)


class ResponseStore:
    """The conversations (chat messages, instructions excluded) of the most recent responses."""

    def __init__(self, limit: int = STORE_LIMIT) -> None:
        self.limit, self.items = limit, OrderedDict[str, list[dict[str, Any]]]()

    def get(self, response_id: str) -> list[dict[str, Any]]:
        if response_id not in self.items:
            raise APIError(f"previous response {response_id!r} not found (only the last {self.limit} are kept)",
                           404, "invalid_request_error", "previous_response_id", "previous_response_not_found")
        self.items.move_to_end(response_id)
        return self.items[response_id]

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        self.items[response_id] = messages
        while len(self.items) > self.limit:
            self.items.popitem(last=False)


def input_messages(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """Responses input as chat messages: ``function_call`` items join the assistant turn's
    ``tool_calls``, ``function_call_output`` items are ``tool`` turns, ``reasoning`` the next
    assistant turn's ``reasoning_content``."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    reasoning = ""
    for item in items:
        kind = item.type or "message"
        if kind == "message":
            try:
                message: dict[str, Any] = {"role": item.role or "user", "content": item.text()}
            except ValueError as exc:
                raise bad_request(str(exc), param="input") from exc
            if message["role"] == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, ""
            out.append(message)
        elif kind == "function_call":
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments or "{}"}}
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
            if reasoning:
                last["reasoning_content"], reasoning = reasoning, ""
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output_text()})
        elif kind == "reasoning":
            try:
                reasoning += "".join(p.text or "" for p in (item.summary or [])) + (item.text() if item.content else "")
            except ValueError as exc:
                raise bad_request(str(exc), param="input") from exc
        else:
            raise bad_request(f"input items of type {kind!r} are not supported", param="input")
    return out


def chat_tools(body: ResponsesRequest) -> tuple[list[dict[str, Any]] | None, str | dict[str, Any] | None]:
    """Function tools and ``tool_choice`` in chat-completions form."""
    tools = None
    if body.tools:
        if bad := [t.get("type") for t in body.tools if t.get("type") != "function"]:
            raise bad_request(f"only function tools are supported, not {bad[0]!r}", param="tools")
        tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
                 for t in body.tools]
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise bad_request("tool_choice must be none, auto, required or a function", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return tools, choice


def responses_turn(body: ResponsesRequest, history: list[dict[str, Any]]) -> Turn:
    """The turn a Responses request asks for, after the ``history`` it continues."""
    tools, choice = chat_tools(body)
    response_format = None
    if body.text is not None and body.text.format is not None and body.text.format.type != "text":
        fmt = body.text.format
        spec = {"name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}
        response_format = ResponseFormat(type=fmt.type, json_schema=spec if fmt.type == "json_schema" else None)
    effort = body.reasoning.effort if body.reasoning is not None else None
    try:
        fields = SamplingFields(model=body.model, temperature=body.temperature, top_p=body.top_p)
    except ValidationError as exc:
        raise bad_request(*validation_message(list(exc.errors()))) from exc
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    return Turn(messages=[*system, *history], fields=fields, max_tokens=body.max_output_tokens, tools=tools,
                tool_choice=choice, response_format=response_format, thinking=False if effort == "none" else None,
                reasoning_budget=effort_budget(effort), effort=effort, prompt_param="input")


def item_id(segment: Segment, response_id: str) -> str:
    prefix = {"text": "msg", "call": "fc", "reasoning": "rs"}[segment.kind]
    return f"{prefix}_{response_id[5:]}_{segment.index}"


def output_item(segment: Segment, response_id: str, done: bool = True) -> dict[str, Any]:
    """The output item of a segment (``done``: whole, else as it is announced)."""
    status = "completed" if done else "in_progress"
    iid = item_id(segment, response_id)
    if segment.kind == "call":
        return {"type": "function_call", "id": iid, "call_id": segment.call_id, "name": segment.name,
                "arguments": segment.text if done else "", "status": status}
    if segment.kind == "reasoning":
        content = [{"type": "reasoning_text", "text": segment.text}] if done else []
        return {"type": "reasoning", "id": iid, "summary": [], "content": content, "status": status}
    content = [text_part(segment.text)] if done else []
    return {"type": "message", "id": iid, "role": "assistant", "status": status, "content": content}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def stream_events(events: list[SegmentEvent], response_id: str) -> list[dict[str, Any]]:
    """The Responses stream events (without sequence numbers) of segment events."""
    out: list[dict[str, Any]] = []
    for e in events:
        s, iid = e.segment, item_id(e.segment, response_id)
        where = {"item_id": iid, "output_index": s.index}
        if e.action == "open":
            out.append({"type": "response.output_item.added", "output_index": s.index,
                        "item": output_item(s, response_id, done=False)})
            if s.kind == "text":
                out.append({"type": "response.content_part.added", **where, "content_index": 0, "part": text_part("")})
        elif e.action == "delta":
            kind = {"text": "response.output_text.delta", "reasoning": "response.reasoning_text.delta",
                    "call": "response.function_call_arguments.delta"}[s.kind]
            extra = {"content_index": 0} if s.kind != "call" else {}
            out.append({"type": kind, **where, **extra, "delta": e.piece, **({"logprobs": []} if s.kind == "text" else {})})
        else:
            if s.kind == "text":
                out.append({"type": "response.output_text.done", **where, "content_index": 0, "text": s.text, "logprobs": []})
                out.append({"type": "response.content_part.done", **where, "content_index": 0, "part": text_part(s.text)})
            elif s.kind == "reasoning":
                out.append({"type": "response.reasoning_text.done", **where, "content_index": 0, "text": s.text})
            else:
                out.append({"type": "response.function_call_arguments.done", **where, "arguments": s.text, "name": s.name})
            out.append({"type": "response.output_item.done", "output_index": s.index, "item": output_item(s, response_id)})
    return out


def continued(history: list[dict[str, Any]], segments: list[Segment]) -> list[dict[str, Any]]:
    """``history`` followed by the reply as an assistant turn (what a next response continues)."""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(s.text for s in segments if s.kind == "text")}
    if reasoning := "".join(s.text for s in segments if s.kind == "reasoning"):
        message["reasoning_content"] = reasoning
    if calls := [{"id": s.call_id, "type": "function", "function": {"name": s.name, "arguments": s.text}}
                 for s in segments if s.kind == "call"]:
        message["tool_calls"] = calls
    return [*history, message]


def responses_router(ctx: ServerContext) -> APIRouter:
    """The Responses route (mounted under the app's authenticated ``/v1``)."""
    router = APIRouter()
    store = ResponseStore()
    served = ctx.served

    @router.post("/responses", response_model=ResponseObject,
                 responses={**streamed_ok(ResponseObject, ResponseStreamEvent), **error_responses(GENERATION)})
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        check_model(ctx, body.model)
        previous = store.get(body.previous_response_id) if body.previous_response_id else []
        history = [*previous, *input_messages(body.input)]
        prepared = await ctx.prepare(lambda: prepare(responses_turn(body, history), served, ctx.traits))
        lease = ctx.submit(prepared.request)
        parser, segmenter = prepared.parser(), Segmenter()
        response_id, created = new_id("resp").replace("-", "_"), time.time()
        reasoning_tokens = [0]

        def response(status: str, last: TokenEvent | None) -> dict[str, Any]:
            done = status in ("completed", "incomplete")
            prompt, cached = (last.prompt_tokens, last.cached_tokens) if last else (0, 0)
            completion = last.completion_tokens if last else 0
            return {
                "id": response_id, "object": "response", "created_at": created, "model": body.model or served.name,
                "status": status, "output": [output_item(s, response_id) for s in segmenter.segments] if done else [],
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "error": None, "instructions": body.instructions, "tools": body.tools or [],
                "tool_choice": body.tool_choice or "auto", "parallel_tool_calls": body.parallel_tool_calls is not False,
                "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
                "previous_response_id": body.previous_response_id, "store": body.store, "metadata": body.metadata or {},
                "text": body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {"format": {"type": "text"}},
                "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                          "output_tokens": completion,
                          "output_tokens_details": {"reasoning_tokens": reasoning_tokens[0]},
                          "total_tokens": prompt + completion} if done else None,
            }

        def absorb(event: TokenEvent) -> list[SegmentEvent]:
            delta = parser.feed(event)
            reasoning_tokens[0] += bool(delta.reasoning)
            return segmenter.feed(delta)

        def finished(event: TokenEvent) -> str:
            if body.store:
                store.put(response_id, continued(history, segmenter.segments))
            return "incomplete" if event.truncated else "completed"

        if body.stream:
            sequence = [0]

            def numbered(payload: dict[str, Any]) -> str:
                payload["sequence_number"], sequence[0] = sequence[0], sequence[0] + 1
                return named_event(payload)

            def on_event(event: TokenEvent) -> list[str]:
                out = []
                if sequence[0] == 0:
                    out += [{"type": "response.created", "response": response("in_progress", None)},
                            {"type": "response.in_progress", "response": response("in_progress", None)}]
                out += stream_events(absorb(event), response_id)
                if event.finish_reason is not None:
                    status = finished(event)
                    out.append({"type": f"response.{status}", "response": response(status, event)})
                return [numbered(payload) for payload in out]

            def on_error(message: str) -> list[str]:
                return [numbered({"type": "error", "code": "server_error", "message": message, "param": None})]

            return ctx.event_stream(frames(lease, on_event, on_error), lease)
        result = await collect_unless_gone(lease, request)
        for event in result.events:
            absorb(event)
        status = finished(result.events[-1]) if result.events else "completed"
        return JSONResponse(response(status, result.last))

    return router
