"""One assistant turn, whichever API asked for it: the API-neutral request (``Turn``) the three
APIs translate into, and its preparation into one engine request plus the parser of its reply.

What the model can do (``Traits``: its tool-call format, whether it reasons) is read once from
the chat template (``serve --tool-parser`` overrides the format)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlxformer.engine import GenerationRequest
from mlxformer.errors import MlxformerError
from mlxformer.server.errors import bad_request
from mlxformer.server.hooks import constraint_for
from mlxformer.server.protocol import ResponseFormat, SamplingFields
from mlxformer.server.reasoning import (
    EFFORT_BUDGETS, THINK, ThinkSplitter, ThinkTags, answer_constraint, reasons, starts_in_reasoning, think_tags,
)
from mlxformer.server.reply import ReplyParser
from mlxformer.server.toolcalls import CallFormat, call_format, format_for_template, reply_stream
from mlxformer.server.toolcalls.harmony import EFFORTS, harmony_messages
from mlxformer.server.tools import ToolPlan, call_constraint, chat_messages, tool_plan
from mlxformer.server.translate import ServedModel, check_prompt_chars, engine_request


@dataclass(frozen=True)
class Traits:
    """What the served model's template teaches: its call format and whether it reasons."""

    call_format: CallFormat
    reasons: bool
    tags: ThinkTags = THINK  # the reasoning's tags (Mistral: [THINK]...[/THINK])
    force_tools: tuple[str, ...] = ()  # serve --force-tool: a user turn's reply calls the first of these offered

    @classmethod
    def of(cls, served: ServedModel, tool_parser: str | None = None, force_tools: tuple[str, ...] = ()) -> Traits:
        """The traits of ``served`` (``tool_parser``: a format name overriding the template's)."""
        name = tool_parser or format_for_template(served.tokenizer.chat_template)
        return cls(call_format(name), reasons(served.tokenizer), think_tags(served.tokenizer), force_tools)

    def capabilities(self, served: ServedModel) -> dict[str, Any]:
        """The ``capabilities`` of a model entry in ``/v1/models``."""
        return {"chat": served.tokenizer.chat_template is not None, "tools": True, "tool_parser": self.call_format.name,
                "reasoning": self.reasons or self.call_format.channels, "structured_output": True}


@dataclass
class Turn:
    """An API-neutral chat request.

    ``messages``: OpenAI-style dicts (``role``, ``content`` text, ``tool_calls`` with arguments
    as strings or objects, ``tool_call_id``, ``reasoning_content``); ``thinking``: ``None`` keeps
    the template's default, ``False`` turns reasoning off; ``reasoning_budget``: the most tokens
    the reasoning may take before ``</think>`` is forced."""

    messages: list[dict[str, Any]]
    fields: SamplingFields
    max_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    logprobs: int | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    thinking: bool | None = None
    reasoning_budget: int | None = None
    effort: str | None = None  # the request's reasoning effort by name (Harmony's template renders it)
    prompt_param: str = "messages"
    max_tokens_param: str = "max_tokens"
    plain_route: str = "/v1/completions"  # where a model without a chat template takes text (Ollama: /api/generate)
    prefill: str = ""  # the start of the reply (Anthropic's assistant prefill): the model continues it


@dataclass
class Prepared:
    """A turn ready to run: the engine request, and how to read its reply."""

    request: GenerationRequest
    plan: ToolPlan
    traits: Traits
    in_reasoning: bool

    def parser(self) -> ReplyParser:
        """A fresh parser of this turn's reply."""
        splitter = ThinkSplitter(self.in_reasoning, self.traits.tags) if self.traits.reasons else None
        channels = self.traits.call_format.channels  # Harmony: its stream reads every reply
        calls = reply_stream(self.traits.call_format, self.plan.spec) if self.plan.active or channels else None
        return ReplyParser(splitter, calls)


def effort_budget(effort: str | None) -> int | None:
    """The reasoning budget of an OpenAI ``reasoning_effort`` (``None``: unbounded)."""
    if effort is None or effort == "none":
        return None
    if effort not in EFFORT_BUDGETS:
        raise bad_request(f"reasoning_effort must be one of none, {', '.join(EFFORT_BUDGETS)}", param="reasoning_effort")
    return EFFORT_BUDGETS[effort]


def harmony_effort(turn: Turn) -> str | None:
    """The ``Reasoning:`` level of Harmony's template for ``turn`` (``None``: the template's default)."""
    if turn.effort in EFFORTS:
        return turn.effort
    if turn.effort in ("minimal", "none") or turn.thinking is False:
        return "low"
    if turn.reasoning_budget is not None:
        return "low" if turn.reasoning_budget <= EFFORT_BUDGETS["low"] else (
            "medium" if turn.reasoning_budget <= EFFORT_BUDGETS["medium"] else "high")
    return None


def render_prompt(turn: Turn, served: ServedModel, plan: ToolPlan, traits: Traits) -> str:
    """The conversation rendered by the chat template, generation prompt added."""
    tokenizer = served.tokenizer
    if not tokenizer.chat_template:
        raise bad_request(f"this model has no chat template: use {turn.plain_route}", param=turn.prompt_param)
    messages, extra = chat_messages(turn.messages, plan, tokenizer.chat_template)
    kwargs = {**turn.template_kwargs, **extra}
    if traits.call_format.channels:  # Harmony: past reasoning as ``thinking``, the effort as a kwarg
        messages = harmony_messages(messages)
        effort = harmony_effort(turn)
        if effort is not None:
            kwargs.setdefault("reasoning_effort", effort)
    if traits.reasons:  # reasoning on unless turned off (templates read enable_thinking; llama.cpp's copies need it set)
        kwargs.setdefault("enable_thinking", turn.thinking is not False)
    try:
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        except MlxformerError:
            if (merged := merge_system(messages)) is messages:
                raise
            text = tokenizer.apply_chat_template(merged, add_generation_prompt=True, **kwargs)
    except MlxformerError as exc:
        raise bad_request(str(exc), param=turn.prompt_param) from exc
    return text + turn.prefill


def merge_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with every system message joined into one leading system message (for a
    template that refuses a system message after the first turn); ``messages`` itself when
    there is nothing to merge."""
    systems = [i for i, m in enumerate(messages) if m["role"] == "system"]
    if not systems or systems == [0]:
        return messages
    text = "\n\n".join(str(messages[i].get("content") or "") for i in systems)
    return [{"role": "system", "content": text}, *(m for m in messages if m["role"] != "system")]


def forced_choice(turn: Turn, names: tuple[str, ...]) -> str | dict[str, Any] | None:
    """``turn``'s tool choice, or (``serve --force-tool``: agents tried with a model that cannot
    choose a tool) a call of the first of ``names`` offered when the client leaves the choice to
    the model and the turn answers a user message (not a tool result)."""
    offered = {t["function"]["name"] for t in turn.tools or []}
    replies = [i for i, m in enumerate(turn.messages) if m["role"] == "assistant"]
    since = {m["role"] for m in turn.messages[replies[-1] + 1 if replies else 0:]}  # since the last reply
    if turn.tool_choice not in (None, "auto") or "user" not in since or "tool" in since or turn.prefill:
        return turn.tool_choice
    name = next((n for n in names if n in offered), None)
    return {"type": "function", "function": {"name": name}} if name else turn.tool_choice


def prepare(turn: Turn, served: ServedModel, traits: Traits) -> Prepared:
    """The engine request of ``turn`` (400s on bad input) and how to parse its reply."""
    plan = tool_plan(turn.tools, forced_choice(turn, traits.force_tools) if traits.force_tools else turn.tool_choice)
    if plan.forced and turn.response_format is not None and turn.response_format.type != "text":
        raise bad_request("a forced tool call cannot also have a response_format", param="tool_choice")
    tokenizer, vocab = served.tokenizer, served.vocab_size
    text = render_prompt(turn, served, plan, traits)
    constraint = call_constraint(plan, traits.call_format, tokenizer, vocab) or constraint_for(
        turn.response_format, tokenizer, vocab)
    in_reasoning = traits.reasons and starts_in_reasoning(text, traits.tags)
    budget = 0 if turn.thinking is False else turn.reasoning_budget
    if traits.reasons:
        constraint = answer_constraint(constraint, tokenizer, vocab, in_reasoning=in_reasoning, budget=budget,
                                       tags=traits.tags)
    check_prompt_chars(len(text), served, turn.prompt_param)
    ids = tokenizer.encode(text, add_special_tokens=False)
    request = engine_request(turn.fields, ids, served, max_tokens=turn.max_tokens, logprobs=turn.logprobs,
                             constraint=constraint, prompt_param=turn.prompt_param,
                             max_tokens_param=turn.max_tokens_param)
    return Prepared(request, plan, traits, in_reasoning)
