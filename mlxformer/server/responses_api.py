"""``POST /v1/responses``: the OpenAI Responses API as a thin translator (input items ->
``Turn``; reply segments -> output items, or the documented event stream), stateless, or
continuing a stored response (``previous_response_id``, a bounded in-memory store)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from mlxformer.engine import TokenEvent
from mlxformer.server.errors import bad_request, validation_message
from mlxformer.server.context import ServerContext
from mlxformer.server.hosting import check_model
from mlxformer.server.sse import frames, named_event
from mlxformer.server.openapi import GENERATION, error_responses, streamed_ok
from mlxformer.server.streaming import collect_unless_gone
from mlxformer.server.protocol import ResponseFormat, SamplingFields, new_id
from mlxformer.server.responses_protocol import InputItem, ResponseObject, ResponsesRequest, ResponseStreamEvent
from mlxformer.server.responses_state import ResponseStore, Stored, ToolSet, seal, tool_set, unseal
from mlxformer.server.segments import ReplySegment, SegmentEvent, Segmenter
from mlxformer.server.turn import Turn, effort_budget, prepare

def input_messages(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """Responses input as chat messages: ``function_call`` items join the assistant turn's
    ``tool_calls``, ``function_call_output`` items are ``tool`` turns, ``reasoning`` the next
    assistant turn's ``reasoning_content``."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise bad_request("input must not be empty", param="input")
    out: list[dict[str, Any]] = []
    reasoning = ""
    for index, item in enumerate(items):
        kind = item.type or "message"
        if kind == "message":
            if item.role is None or item.content is None:
                raise bad_request(f"input[{index}]: a message item needs a role and content", param="input")
            try:
                message: dict[str, Any] = {"role": item.role or "user", "content": item.text()}
            except ValueError as exc:
                raise bad_request(str(exc), param="input") from exc
            if message["role"] == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, ""
            out.append(message)
        elif kind in ("function_call", "custom_tool_call"):
            arguments = item.arguments or "{}" if kind == "function_call" else json.dumps({"input": item.input or ""})
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": arguments}}
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
            if reasoning:
                last["reasoning_content"], reasoning = reasoning, ""
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output_text()})
        elif kind == "reasoning":
            try:
                reasoning += ("".join(p.text or "" for p in (item.summary or [])) + (item.text() if item.content else "")
                              or unseal(item.encrypted_content))
            except ValueError as exc:
                raise bad_request(str(exc), param="input") from exc
        else:
            raise bad_request(f"input items of type {kind!r} are not supported", param="input")
    return out


def chat_choice(body: ResponsesRequest) -> str | dict[str, Any] | None:
    """``tool_choice`` in chat-completions form (one naming a hosted tool: see ``tool_set``)."""
    choice = body.tool_choice
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def responses_turn(body: ResponsesRequest, history: list[dict[str, Any]], tools: ToolSet) -> Turn:
    """The turn a Responses request asks for, after the ``history`` it continues."""
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
    return Turn(messages=[*system, *history], fields=fields, max_tokens=body.max_output_tokens, tools=tools.tools,
                tool_choice=chat_choice(body), response_format=response_format, thinking=False if effort == "none" else None,
                reasoning_budget=effort_budget(effort), effort=effort, prompt_param="input")


def item_id(segment: ReplySegment, response_id: str) -> str:
    prefix = {"text": "msg", "call": "fc", "reasoning": "rs"}[segment.kind]
    return f"{prefix}_{response_id[5:]}_{segment.index}"


@dataclass
class Items:
    """How one response writes its output items: its id, the namespace each function came from
    (Codex's ``namespace`` tools), whether reasoning items carry ``encrypted_content``, and
    whether the reply was cut by ``max_output_tokens`` (its last item is then incomplete)."""

    response_id: str
    segmenter: Segmenter
    namespaces: dict[str, str] = field(default_factory=dict)
    sealed: bool = False
    cut: bool = False

    def status(self, segment: ReplySegment, done: bool) -> str:
        if not done:
            return "in_progress"
        last = self.segmenter.segments[-1] is segment
        return "incomplete" if self.cut and last else "completed"

    def item(self, segment: ReplySegment, done: bool = True) -> dict[str, Any]:
        """The output item of a segment (``done``: whole, else as it is announced)."""
        status, iid = self.status(segment, done), item_id(segment, self.response_id)
        if segment.kind == "call":
            namespace = {"namespace": self.namespaces[segment.name]} if segment.name in self.namespaces else {}
            return {"type": "function_call", "id": iid, "call_id": segment.call_id, "name": segment.name, **namespace,
                    "arguments": segment.text if done else "", "status": status}
        if segment.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": segment.text}] if done else []
            sealed = {"encrypted_content": seal(segment.text)} if self.sealed and done else {}
            return {"type": "reasoning", "id": iid, "summary": [], "content": content, **sealed, "status": status}
        content = [text_part(segment.text)] if done else []
        return {"type": "message", "id": iid, "role": "assistant", "status": status, "content": content}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def stream_events(events: list[SegmentEvent], items: Items) -> list[dict[str, Any]]:
    """The Responses stream events (without sequence numbers) of segment events."""
    out: list[dict[str, Any]] = []
    for e in events:
        s, iid = e.segment, item_id(e.segment, items.response_id)
        where = {"item_id": iid, "output_index": s.index}
        if e.action == "open":
            out.append({"type": "response.output_item.added", "output_index": s.index,
                        "item": items.item(s, done=False)})
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
            out.append({"type": "response.output_item.done", "output_index": s.index, "item": items.item(s)})
    return out


def continued(history: list[dict[str, Any]], segments: list[ReplySegment]) -> list[dict[str, Any]]:
    """``history`` followed by the reply as an assistant turn (what a next response continues)."""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(s.text for s in segments if s.kind == "text")}
    if reasoning := "".join(s.text for s in segments if s.kind == "reasoning"):
        message["reasoning_content"] = reasoning
    if calls := [{"id": s.call_id, "type": "function", "function": {"name": s.name, "arguments": s.text}}
                 for s in segments if s.kind == "call"]:
        message["tool_calls"] = calls
    return [*history, message]


def responses_router(ctx: ServerContext) -> APIRouter:
    """The Responses routes (mounted under the app's authenticated ``/v1``): create, and
    retrieve or delete a stored response."""
    router = APIRouter()
    store = ResponseStore()
    served = ctx.served

    @router.get("/responses/{response_id}", response_model=ResponseObject, responses=error_responses([404]))
    async def retrieve(response_id: str) -> JSONResponse:
        return JSONResponse(store.get(response_id, param=None).response)

    @router.delete("/responses/{response_id}", responses=error_responses([404]))
    async def delete(response_id: str) -> dict[str, Any]:
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @router.post("/responses", response_model=ResponseObject,
                 responses={**streamed_ok(ResponseObject, ResponseStreamEvent), **error_responses(GENERATION)})
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        check_model(ctx, body.model)
        previous = store.get(body.previous_response_id).messages if body.previous_response_id else []
        history = [*previous, *input_messages(body.input)]
        tools = tool_set(body.tools, body.tool_choice)
        prepared = await ctx.prepare(lambda: prepare(responses_turn(body, history, tools), served, ctx.traits))
        lease = ctx.submit(prepared.request, "responses")
        parser, segmenter = prepared.parser(), Segmenter()
        response_id, created = new_id("resp").replace("-", "_"), int(time.time())
        items = Items(response_id, segmenter, tools.namespaces, "reasoning.encrypted_content" in (body.include or []))
        reasoning_tokens = [0]

        def response(status: str, last: TokenEvent | None) -> dict[str, Any]:
            done = status in ("completed", "incomplete")
            prompt, cached = (last.prompt_tokens, last.cached_tokens) if last else (0, 0)
            completion = last.completion_tokens if last else 0
            return {
                "id": response_id, "object": "response", "created_at": created, "model": body.model or served.name,
                "status": status, "output": [items.item(s) for s in segmenter.segments] if done else [],
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "error": None, "instructions": body.instructions, "tools": body.tools or [],
                "tool_choice": body.tool_choice or "auto", "parallel_tool_calls": body.parallel_tool_calls is not False,
                "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
                "previous_response_id": body.previous_response_id, "store": body.store, "metadata": body.metadata or {},
                "text": body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {"format": {"type": "text"}},
                "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                          "output_tokens": completion,
                          "output_tokens_details": {"reasoning_tokens": reasoning_tokens[0]},
                          "total_tokens": prompt + completion,
                          **({"max_tokens": lease.cut} if lease.cut is not None else {})} if done else None,
                **({"warnings": tools.warnings()} if tools.ignored else {}),
            }

        def absorb(event: TokenEvent) -> list[SegmentEvent]:
            delta = parser.feed(event)
            reasoning_tokens[0] += bool(delta.reasoning)
            items.cut = items.cut or event.truncated
            return segmenter.feed(delta)

        def finished(event: TokenEvent | None) -> dict[str, Any]:
            """The final response (stored, with the conversation it ends, when ``store``)."""
            final = response("incomplete" if event is not None and event.truncated else "completed", event)
            if body.store:
                store.put(response_id, Stored(continued(history, segmenter.segments), final))
            return final

        if body.stream:
            sequence = [0]

            def numbered(payload: dict[str, Any]) -> str:
                payload["sequence_number"], sequence[0] = sequence[0], sequence[0] + 1
                return named_event(payload)

            def on_event(event: TokenEvent) -> list[str]:
                out = stream_events(absorb(event), items)
                if event.finish_reason is not None:
                    final = finished(event)
                    out.append({"type": f"response.{final['status']}", "response": final})
                return [numbered(payload) for payload in out]

            def on_error(message: str) -> list[str]:  # OpenAI's order: the error, then the failed response
                failed = {**response("failed", None), "error": {"code": "server_error", "message": message}}
                return [numbered({"type": "error", "code": "server_error", "message": message, "param": None}),
                        numbered({"type": "response.failed", "response": failed})]

            # announced as soon as the request is admitted, before a long prefill
            opening = [numbered({"type": kind, "response": response("in_progress", None)})
                       for kind in ("response.created", "response.in_progress")]
            return ctx.event_stream(frames(lease, on_event, on_error, opening), lease)
        result = await collect_unless_gone(lease, request)
        for event in result.events:
            absorb(event)
        return JSONResponse(finished(result.last), headers=lease.headers)

    return router
