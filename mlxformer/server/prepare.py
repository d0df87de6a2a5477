"""Preparing an API request for the engine: checks, the chat template, tokenization and the
grammar of structured output. CPU-bound, so the routers run it on the context's thread pool
(``ServerContext.prepare``), never on the event loop."""

from __future__ import annotations

from dataclasses import dataclass

from mlxformer.engine import GenerationRequest
from mlxformer.errors import MlxformerError
from mlxformer.sampling import TokenConstraint
from mlxformer.server.errors import bad_request
from mlxformer.server.hooks import constraint_for
from mlxformer.server.protocol import ChatCompletionRequest, CompletionRequest
from mlxformer.server.tools import ToolPlan, call_constraint, tool_plan
from mlxformer.server.translate import (
    ServedModel, chat_prompt_text, check_model_name, check_prompt_chars, completion_prompt_ids, engine_request,
)

MAX_MESSAGE_CHARS = 300  # a matcher error may quote the whole grammar


@dataclass
class PreparedChat:
    """A chat request ready to submit, and the tool plan its reply is read with."""

    request: GenerationRequest
    plan: ToolPlan


@dataclass
class PreparedCompletion:
    """A text-completion request ready to submit, with its prompt ids (for ``echo``).
    ``score_only`` (``max_tokens: 0``): the one token generated is not part of the reply."""

    request: GenerationRequest
    prompt_ids: list[int]
    score_only: bool = False


def prepare_chat(body: ChatCompletionRequest, served: ServedModel) -> PreparedChat:
    """Check ``body``, render and tokenize the conversation, compile its constraint."""
    check_model_name(body.model, served)
    plan = tool_plan(body.tools, body.tool_choice)
    if plan.forced and body.response_format is not None and body.response_format.type != "text":
        raise bad_request("a forced tool call cannot also have a response_format", param="tool_choice")
    text = chat_prompt_text(body, served.tokenizer, plan)
    check_prompt_chars(len(text), served, "messages")
    ids = served.tokenizer.encode(text, add_special_tokens=False)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    constraint: TokenConstraint | None = call_constraint(plan, served.tokenizer, served.vocab_size) or constraint_for(
        body.response_format, served.tokenizer, served.vocab_size
    )
    check_first_mask(constraint, "tool_choice" if plan.forced else "response_format")
    top = (body.top_logprobs or 0) if body.logprobs else None
    request = engine_request(body, ids, served, max_tokens=max_tokens, logprobs=top, constraint=constraint,
                             prompt_param="messages", max_tokens_param=param)
    return PreparedChat(request, plan)


def check_first_mask(constraint: TokenConstraint | None, param: str) -> None:
    """Compute the constraint's first mask now: a grammar that compiles but overflows the matcher's
    limits at once is a 400 for this request (with a short message), not a failure in the engine."""
    if constraint is None:
        return
    try:
        constraint.next_mask()
    except MlxformerError as exc:
        message = str(exc)
        short = message if len(message) <= MAX_MESSAGE_CHARS else message[:MAX_MESSAGE_CHARS] + "..."
        raise bad_request(f"the constraint cannot be applied: {short}", param=param,
                          code="invalid_response_format") from None


def prepare_completion(body: CompletionRequest, served: ServedModel) -> PreparedCompletion:
    """Check ``body`` and tokenize its prompt."""
    check_model_name(body.model, served)
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    ids = completion_prompt_ids(body, served)
    score_only = body.max_tokens == 0  # the engine makes at least one token: it is dropped
    request = engine_request(body, ids, served, max_tokens=1 if score_only else body.max_tokens,
                             logprobs=body.logprobs, prompt_param="prompt")
    if body.echo and body.logprobs is not None:
        request.prompt_logprobs = body.logprobs  # the engine scores the prompt while prefilling it
    return PreparedCompletion(request, ids, score_only)
