"""Preparing an API request for the engine: checks, the chat template, tokenization and the
grammar of structured output. CPU-bound, so the routers run it on the context's thread pool
(``ServerContext.prepare``), never on the event loop."""

from __future__ import annotations

from dataclasses import dataclass

from mlxformer.engine import GenerationRequest
from mlxformer.server.chat_turn import chat_turn
from mlxformer.server.errors import bad_request
from mlxformer.server.hooks import constraint_for
from mlxformer.server.protocol import ChatCompletionRequest, CompletionRequest
from mlxformer.server.translate import ServedModel, completion_prompt_ids, engine_request
from mlxformer.server.turn import Prepared, Traits, prepare

@dataclass
class PreparedCompletion:
    """A text-completion request ready to submit, with its prompt ids (for ``echo``).
    ``score_only`` (``max_tokens: 0``): the one token generated is not part of the reply."""

    request: GenerationRequest
    prompt_ids: list[int]
    score_only: bool = False


def prepare_chat(body: ChatCompletionRequest, served: ServedModel, traits: Traits) -> Prepared:
    """Check ``body``, render and tokenize the conversation, compile its constraint."""
    return prepare(chat_turn(body), served, traits)


def prepare_completion(body: CompletionRequest, served: ServedModel) -> PreparedCompletion:
    """Check ``body``, tokenize its prompt, compile its ``response_format`` (vLLM's extension)."""
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    ids = completion_prompt_ids(body, served)
    score_only = body.max_tokens == 0  # the engine makes at least one token: it is dropped
    constraint = constraint_for(body.response_format, served.tokenizer, served.vocab_size)
    request = engine_request(body, ids, served, max_tokens=body.max_tokens,
                             logprobs=body.logprobs, constraint=constraint, prompt_param="prompt")
    if body.echo and body.logprobs is not None:
        request.prompt_logprobs = body.logprobs  # the engine scores the prompt while prefilling it
    return PreparedCompletion(request, ids, score_only)
