"""Tool calling for the APIs (``tools`` + ``tool_choice``): what the model is offered, the
conversation as the chat template wants it, and the constraint of a forced call.

``tool_choice`` ``"required"`` or a named function forces a call: the output is constrained
(llguidance) to one call written in the model's own format (``toolcalls``), its arguments
following the function's parameter schema. ``"auto"`` (the default when tools are given) lets
the model answer or call; ``"none"`` hides the tools.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mlxformer.constrained import make_constraint
from mlxformer.constrained.tools import forced_functions, function_specs, with_tools
from mlxformer.errors import MlxformerError
from mlxformer.sampling.samplers import TokenConstraint
from mlxformer.server.errors import bad_request
from mlxformer.server.toolcalls import CallFormat, ToolSpec
from mlxformer.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools: those offered to the model (none for ``tool_choice: "none"``) and the
    functions one of which must be called (none unless forced)."""

    tools: list[dict[str, Any]] | None
    forced: list[str]

    @property
    def active(self) -> bool:
        return bool(self.tools)

    @property
    def spec(self) -> ToolSpec:
        """The offered functions' parameter schemas, for the call parsers."""
        return ToolSpec({name: s["parameters"] for name, s in function_specs(self.tools).items()})


def tool_plan(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> ToolPlan:
    """Check ``tools``/``tool_choice`` (a 400 on bad input) and decide what the model is offered."""
    try:
        forced = forced_functions(tools, tool_choice)
    except MlxformerError as exc:
        raise bad_request(str(exc), param="tool_choice" if "tool_choice" in str(exc) else "tools") from exc
    return ToolPlan(None if tool_choice == "none" or not tools else tools, forced)


def call_constraint(plan: ToolPlan, fmt: CallFormat, tokenizer: Tokenizer, vocab_size: int) -> TokenConstraint | None:
    """The constraint of a forced call in ``fmt`` (``None`` unless a call is forced)."""
    if not plan.forced:
        return None
    try:
        return make_constraint(tokenizer, vocab_size, grammar=fmt.forced_grammar(plan.forced, plan.spec))
    except MlxformerError as exc:
        raise bad_request(f"a function's parameters do not compile: {exc}", param="tools") from exc


def chat_messages(messages: list[dict[str, Any]], plan: ToolPlan, chat_template: str | None
                  ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The conversation for the chat template and its extra keywords (``tools`` where the template
    renders them; otherwise the tools are described in the system message, earlier calls shown as
    their JSON and tool results as user turns). Earlier calls' arguments are objects (templates
    apply ``tojson`` to them), parsed from OpenAI's strings."""
    takes_tools = bool(plan.tools) and "tools" in with_tools([], plan.tools, chat_template)[1]
    rendered: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        message: dict[str, Any] = {**m, "role": role, "content": m.get("content") or ""}
        calls = [_with_object_arguments(c) for c in m.get("tool_calls") or []]
        message.pop("tool_calls", None)
        if calls:
            if takes_tools:
                message["tool_calls"] = calls
            elif not message["content"]:
                message["content"] = json.dumps([c["function"] for c in calls], ensure_ascii=False)
        if role == "tool" and not takes_tools:
            message = {"role": "user", "content": f"Tool result: {message['content']}"}
        rendered.append(message)
    return with_tools(rendered, plan.tools, chat_template)


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass
    return {**call, "type": call.get("type", "function"),
            "function": {"name": function.get("name"), "arguments": arguments}}
