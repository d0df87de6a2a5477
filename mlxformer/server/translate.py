"""From validated API requests to engine requests: prompt token ids (through the chat
template for chat), the context-length check, sampling settings, stops and logit bias."""

from __future__ import annotations

from dataclasses import dataclass

from mlxformer.engine import GenerationRequest
from mlxformer.errors import OptionError
from mlxformer.options import SamplingSettings
from mlxformer.models.decoder import Model
from mlxformer.sampling import TokenConstraint
from mlxformer.server.errors import APIError, bad_request
from mlxformer.server.protocol import (
    MAX_STOP_STRINGS, CompletionRequest, SamplingFields,
)
from mlxformer.tokenizer import Tokenizer

DEFAULT_MAX_TOKENS = 512  # completion length when the request gives none (capped by the context)
OPENAI_DEFAULT_TEMPERATURE = 1.0
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class ServedModel:
    """What the API needs to know about the model it serves."""

    name: str
    tokenizer: Tokenizer
    context_length: int  # the model's max_position_embeddings
    vocab_size: int  # the model's logits width (may exceed the tokenizer's vocabulary)
    default_max_tokens: int = DEFAULT_MAX_TOKENS

    @classmethod
    def of(cls, name: str, model: Model, tokenizer: Tokenizer) -> ServedModel:
        """The description of ``model`` served as ``name``."""
        return cls(name, tokenizer, model.args.max_position_embeddings, model.args.vocab_size)


def check_model_name(requested: str | None, served: ServedModel) -> None:
    """404 unless the request names the served model (or names none)."""
    if requested and requested != served.name:
        raise APIError(
            f"the model {requested!r} does not exist; this server serves {served.name!r}",
            404, "invalid_request_error", "model", "model_not_found",
        )


def completion_prompt_ids(request: CompletionRequest, tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    """Token ids of a completion prompt: text (BOS added as the tokenizer is configured) or ids."""
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise bad_request("only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    vocab = min(tokenizer.vocab_size, vocab_size)
    if bad := [i for i in prompt if not 0 <= i < vocab]:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary (size {vocab})", param="prompt")
    return list(prompt)


def completion_budget(prompt_tokens: int, requested: int | None, served: ServedModel, param: str) -> int:
    """The max tokens to generate; 400 when the prompt (plus an explicit ``requested``) exceeds the context."""
    context = served.context_length
    if prompt_tokens == 0:
        raise bad_request("the prompt is empty", param=param)
    if prompt_tokens >= context or (requested is not None and prompt_tokens + requested > context):
        wanted = prompt_tokens + (requested or 0)
        raise bad_request(
            f"this model's maximum context length is {context} tokens; the request needs {wanted} "
            f"({prompt_tokens} in the prompt, {requested or 0} for the completion)",
            param=param, code="context_length_exceeded",
        )
    return requested if requested is not None else min(served.default_max_tokens, context - prompt_tokens)


def logit_bias_ids(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """``{"token id": bias}`` with string keys (JSON) as ``{id: bias}``, ids and values checked."""
    if not bias:
        return None
    result: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias token id {token} is outside the vocabulary", param="logit_bias")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise bad_request("logit_bias values must be between -100 and 100", param="logit_bias")
        result[token] = float(value)
    return result


def sampling_of(fields: SamplingFields, vocab_size: int) -> SamplingSettings:
    """The engine's sampling settings (OpenAI defaults: temperature 1, top_p 1); a bad value is
    a 400 naming the field (``SamplingSettings`` validates them)."""
    temperature = OPENAI_DEFAULT_TEMPERATURE if fields.temperature is None else fields.temperature
    try:
        return SamplingSettings(
            temp=temperature,
            top_p=1.0 if fields.top_p is None else fields.top_p,
            top_k=max(fields.top_k or 0, 0),
            min_p=fields.min_p or 0.0,
            repetition_penalty=fields.repetition_penalty,
            presence_penalty=fields.presence_penalty,
            frequency_penalty=fields.frequency_penalty,
            logit_bias=logit_bias_ids(fields.logit_bias, vocab_size),
            seed=fields.seed,
        )
    except OptionError as exc:
        param = "temperature" if exc.param == "temp" else exc.param
        raise bad_request(f"{param} {exc.message}", param=param) from exc


def engine_request(
    fields: SamplingFields,
    prompt_ids: list[int],
    served: ServedModel,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    constraint: TokenConstraint | None = None,
    prompt_param: str = "messages",
) -> GenerationRequest:
    """The engine request for a validated API request whose prompt is ``prompt_ids``."""
    if fields.n != 1:
        raise bad_request("n > 1 is not supported: send one request per completion", param="n")
    stops = fields.stop_strings()
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    budget = completion_budget(len(prompt_ids), max_tokens, served, prompt_param)
    return GenerationRequest(
        prompt_ids=prompt_ids,
        max_tokens=budget,
        sampling=sampling_of(fields, served.vocab_size),
        stop=tuple(stops),
        logprobs=logprobs,
        constraint=constraint,
    )
