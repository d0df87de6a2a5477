"""Chat Completions -> ``Turn``: the request's messages, tools, response format and reasoning
options (``chat_template_kwargs``, ``reasoning_effort``, ``reasoning_budget``)."""

from __future__ import annotations

from mlxformer.server.errors import bad_request
from mlxformer.server.protocol import ChatCompletionRequest
from mlxformer.server.turn import Turn, effort_budget


def chat_turn(body: ChatCompletionRequest) -> Turn:
    """The turn a chat completion request asks for."""
    if body.top_logprobs is not None and not body.logprobs:  # OpenAI's rule: not silently ignored
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    kwargs = dict(body.chat_template_kwargs or {})
    thinking = kwargs.pop("enable_thinking", None)
    if body.reasoning_effort == "none":
        thinking = False
    budget = body.reasoning_budget if body.reasoning_budget is not None else effort_budget(body.reasoning_effort)
    return Turn(
        messages=[m.template_dict() for m in body.messages], fields=body,
        max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        max_tokens_param="max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
        tools=body.tools, tool_choice=body.tool_choice, response_format=body.response_format,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        template_kwargs=kwargs, thinking=None if thinking is None else bool(thinking), reasoning_budget=budget,
        effort=body.reasoning_effort,
    )
