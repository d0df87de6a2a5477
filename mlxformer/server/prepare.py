"""Preparing an API request for the engine: checks, the chat template, tokenization and the
grammar of structured output. CPU-bound, so the routers run it on the context's thread pool
(``ServerContext.prepare``), never on the event loop."""

from __future__ import annotations

from dataclasses import dataclass

from mlxformer.engine import GenerationRequest
from mlxformer.errors import MlxformerError
from mlxformer.sampling import TokenConstraint
from mlxformer.server.chat_turn import chat_turn
from mlxformer.server.errors import bad_request
from mlxformer.server.protocol import ChatCompletionRequest, CompletionRequest
from mlxformer.server.translate import ServedModel, check_model_name, completion_prompt_ids, engine_request
from mlxformer.server.turn import Prepared, Traits, prepare

MAX_MESSAGE_CHARS = 300  # a matcher error may quote the whole grammar


@dataclass
class PreparedCompletion:
    """A text-completion request ready to submit, with its prompt ids (for ``echo``).
    ``score_only`` (``max_tokens: 0``): the one token generated is not part of the reply."""

    request: GenerationRequest
    prompt_ids: list[int]
    score_only: bool = False


def prepare_chat(body: ChatCompletionRequest, served: ServedModel, traits: Traits) -> Prepared:
    """Check ``body``, render and tokenize the conversation, compile its constraint."""
    check_model_name(body.model, served)
    prepared = prepare(chat_turn(body), served, traits)
    check_first_mask(prepared.request.constraint, "tool_choice" if prepared.plan.forced else "response_format")
    return prepared


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
