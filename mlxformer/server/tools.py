"""Tool calling for chat completions (``tools`` + ``tool_choice``) over structured output.

``tool_choice`` ``"required"`` or a named function forces a call: the output is constrained to
``{"name": ..., "arguments": {...}}`` with the arguments following the function's parameter
schema. ``"auto"`` (the default when tools are given) lets the model answer or call. Calls come
back as OpenAI ``tool_calls`` with ``finish_reason`` ``"tool_calls"``; when streaming, text that
may still become a call is held back until it is known.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from mlxformer.constrained import make_constraint
from mlxformer.constrained.tools import ToolCall, forced_functions, parse_tool_calls, tool_call_schema, with_tools
from mlxformer.engine import TokenEvent
from mlxformer.errors import MlxformerError
from mlxformer.sampling import TokenConstraint
from mlxformer.server.errors import bad_request
from mlxformer.server.protocol import ChatCompletionChunk, ChatChunkChoice, ChatMessage, Delta
from mlxformer.server.responses import ChunkMaker
from mlxformer.tokenizer import Tokenizer

CALL_STARTS = ("{", "[", "<tool_call>", "```")  # how a call may begin (see parse_tool_calls)


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools: those offered to the model (none for ``tool_choice: "none"``) and the
    functions one of which must be called (none unless forced)."""

    tools: list[dict[str, Any]] | None
    forced: list[str]

    @property
    def active(self) -> bool:
        return bool(self.tools)


def tool_plan(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> ToolPlan:
    """Check ``tools``/``tool_choice`` (a 400 on bad input) and decide what the model is offered."""
    try:
        forced = forced_functions(tools, tool_choice)
    except MlxformerError as exc:
        raise bad_request(str(exc), param="tool_choice" if "tool_choice" in str(exc) else "tools") from exc
    return ToolPlan(None if tool_choice == "none" or not tools else tools, forced)


def call_constraint(plan: ToolPlan, tokenizer: Tokenizer, vocab_size: int) -> TokenConstraint | None:
    """The constraint of a forced call (``None`` unless a call is forced)."""
    if not plan.forced:
        return None
    try:
        return make_constraint(tokenizer, vocab_size, response_format=tool_call_schema(plan.tools, plan.forced))
    except MlxformerError as exc:
        raise bad_request(f"a function's parameters do not compile: {exc}", param="tools") from exc


def chat_messages(messages: list[ChatMessage], plan: ToolPlan, chat_template: str | None
                  ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The conversation for the chat template and its extra keywords (``tools`` where the template
    renders them; otherwise the tools are described in the system message, earlier calls shown as
    their JSON and tool results as user turns)."""
    takes_tools = bool(plan.tools) and "tools" in with_tools([], plan.tools, chat_template)[1]
    rendered: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        message: dict[str, Any] = {"role": role, "content": m.text()}
        if m.tool_calls:
            if takes_tools:
                message["tool_calls"] = m.tool_calls
            elif not message["content"]:
                message["content"] = json.dumps([_call_json(c) for c in m.tool_calls], ensure_ascii=False)
        if role == "tool":
            if takes_tools:
                message["tool_call_id"] = m.tool_call_id
            else:
                message = {"role": "user", "content": f"Tool result: {m.text()}"}
        rendered.append(message)
    return with_tools(rendered, plan.tools, chat_template)


def _call_json(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        pass
    return {"name": function.get("name"), "arguments": arguments}


def calls_in(text: str, plan: ToolPlan) -> list[ToolCall]:
    """The tool calls ``text`` makes (none when no tools are active)."""
    return parse_tool_calls(text, plan.tools) if plan.active else []


def tool_call_deltas(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """``delta.tool_calls`` entries of a streamed chunk."""
    return [{"index": i, **call.to_openai()} for i, call in enumerate(calls)]


def tool_chunk_maker(request_id: str, model: str, plan: ToolPlan, inner: ChunkMaker) -> ChunkMaker:
    """Wraps the chat chunk maker: while the text so far may still be a call it is held back; at
    the end a call becomes one ``tool_calls`` chunk, anything else is sent as content."""
    held: list[str] = []
    holding = [True]

    def make(event: TokenEvent) -> BaseModel | None:
        if not holding[0]:
            return inner(event)
        held.append(event.text)
        text = "".join(held)
        stripped = text.lstrip()
        if event.finish_reason is None:
            if not stripped or any(s.startswith(stripped[: len(s)]) for s in CALL_STARTS):
                return None
            holding[0] = False  # plain text: send what was held, then stream as usual
            return inner(_with_text(event, text))
        calls = calls_in(text, plan)
        if not calls:
            return inner(_with_text(event, text))
        delta = Delta(tool_calls=tool_call_deltas(calls))
        choice = ChatChunkChoice(delta=delta, finish_reason="tool_calls")
        return ChatCompletionChunk(id=request_id, model=model, choices=[choice])

    return make


def _with_text(event: TokenEvent, text: str) -> TokenEvent:
    return TokenEvent(text, event.token, event.logprob, event.top_logprobs, event.finish_reason,
                      event.prompt_tokens, event.completion_tokens, event.cached_tokens)
