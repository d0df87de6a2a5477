"""From validated API requests to engine requests: prompt token ids (through the chat
template for chat), the context-length check, sampling settings, stops and logit bias."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from mlxformer.engine import GenerationRequest
from mlxformer.adapters.layers import AdapterBank
from mlxformer.errors import MlxformerError, OptionError
from mlxformer.generation.decoding import check_prompt_ids
from mlxformer.sampling.model_defaults import NO_DEFAULTS, SamplingDefaults
from mlxformer.sampling.options import SamplingSettings
from mlxformer.models.decoder import Model
from mlxformer.sampling.samplers import TokenConstraint
from mlxformer.server.errors import APIError, bad_request
from mlxformer.server.protocol import (
    MAX_STOP_STRINGS, CompletionRequest, SamplingFields,
)
from mlxformer.text.tokenizer import Tokenizer

API_NAMES = {"temp": "temperature"}  # SamplingSettings field -> OpenAI request field, where they differ


@dataclass(frozen=True)
class ServedModel:
    """What the API needs to know about the model it serves."""

    name: str
    tokenizer: Tokenizer
    context_length: int  # the model's max_position_embeddings
    vocab_size: int  # the model's logits width (may exceed the tokenizer's vocabulary)
    adapters: AdapterBank | None = None  # the adapters requests choose from (``serve --lora``)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (its vocabulary entry's length bounds it):
        a prompt of more than ``context_length`` times this many characters cannot fit."""
        backend = self.tokenizer.backend
        return max((len(backend.id_to_token(i) or "") for i in range(self.tokenizer.vocab_size)), default=1) or 1

    @classmethod
    def of(cls, name: str, model: Model, tokenizer: Tokenizer) -> ServedModel:
        """The description of ``model`` served as ``name``."""
        bank = model.adapter_bank
        choosable = bank if isinstance(bank, AdapterBank) and not bank.always_on else None
        return cls(name, tokenizer, model.args.max_position_embeddings, model.args.vocab_size, choosable)

    def adapter_named(self, requested: str | None) -> str | None:
        """The adapter a model name ``BASE:NAME`` picks (None: the name picks none)."""
        base, _, adapter = (requested or "").rpartition(":")
        return adapter if self.adapters is not None and base and adapter in self.adapters.names else None

    def reply_name(self, requested: str | None) -> str:
        """The model a reply names: ``BASE:NAME`` when the request picked an adapter by it, else this model."""
        return f"{self.name}:{adapter}" if (adapter := self.adapter_named(requested)) else self.name

    def base_name(self, requested: str | None) -> str | None:
        """``requested`` without the adapter it picks (``adapter_named``)."""
        return requested.rpartition(":")[0] if requested and self.adapter_named(requested) else requested


def context_exceeded(served: ServedModel, wanted: str, param: str) -> APIError:
    """The 400 of a request that cannot fit the context."""
    return bad_request(
        f"this model's maximum context length is {served.context_length} tokens; the request needs {wanted}",
        param=param, code="context_length_exceeded",
    )


def check_prompt_chars(chars: int, served: ServedModel, param: str) -> None:
    """Refuse, before tokenizing it, a prompt whose length in characters already proves it longer
    than the context (no token stands for more than ``served.max_token_chars`` characters)."""
    if chars > served.context_length * served.max_token_chars:
        raise context_exceeded(served, f"more than that for a prompt of {chars} characters", param)


def completion_prompt_ids(request: CompletionRequest, served: ServedModel) -> list[int]:
    """Token ids of a completion prompt: text (BOS added as the tokenizer is configured) or ids,
    alone or as a one-element list. An empty prompt starts from the BOS (else the EOS) token, as
    OpenAI's models start from ``<|endoftext|>``."""
    tokenizer, prompt = served.tokenizer, request.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise bad_request("only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        check_prompt_chars(len(prompt), served, "prompt")
        ids = tokenizer.encode(prompt)
    else:
        try:
            ids = check_prompt_ids(prompt, min(tokenizer.vocab_size, served.vocab_size))
        except OptionError as exc:
            raise bad_request(exc.message, param="prompt") from None
    if not ids:
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_ids[0]
        ids = [start]
    return ids


def completion_budget(prompt_tokens: int, requested: int | None, served: ServedModel, param: str,
                      max_tokens_param: str = "max_tokens") -> int:
    """The max tokens to generate: ``requested``, or by default the rest of the context (OpenAI's
    default); 400 when the prompt (``param``) or the prompt plus ``requested`` (``max_tokens_param``)
    exceeds the context (a prompt of the whole context is scored when ``requested`` is 0)."""
    context = served.context_length
    if prompt_tokens == 0:
        raise bad_request("the prompt is empty", param=param)
    if prompt_tokens > context or (prompt_tokens == context and requested != 0):
        raise context_exceeded(served, f"{prompt_tokens} tokens for the prompt alone", param)
    if requested is not None and prompt_tokens + requested > context:
        raise context_exceeded(
            served, f"{prompt_tokens + requested} ({prompt_tokens} in the prompt, {requested} for the completion)",
            max_tokens_param,
        )
    return requested if requested is not None else context - prompt_tokens


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float] | None:
    """``{"token id": bias}`` with JSON's string keys as ``{id: bias}`` (the values and the ids'
    range are checked by ``SamplingSettings``)."""
    if not bias:
        return None
    try:
        return {int(key): value for key, value in bias.items()}
    except ValueError:
        bad = next(k for k in bias if not k.strip().lstrip("+-").isdigit())
        raise bad_request(f"logit_bias key {bad!r} is not a token id", param="logit_bias") from None


def sampling_of(fields: SamplingFields, vocab_size: int, defaults: SamplingDefaults = NO_DEFAULTS) -> SamplingSettings:
    """The engine's sampling settings: each field the request leaves out is the model's default,
    else ``SamplingSettings``'s (greedy, no filters): the rule the CLI shares (``model_defaults.py``;
    ``top_k`` -1 is off, as in vLLM). Every bound is ``SamplingSettings``'s own validation: its
    ``OptionError`` becomes a 400 naming the API's field."""
    try:
        settings = defaults.apply(
            temp=fields.temperature,
            top_p=fields.top_p,
            top_k=0 if fields.top_k == -1 else fields.top_k,
            min_p=fields.min_p,
            repetition_penalty=fields.repetition_penalty,
            presence_penalty=fields.presence_penalty or 0.0,
            frequency_penalty=fields.frequency_penalty or 0.0,
            logit_bias=logit_bias_ids(fields.logit_bias),
            seed=fields.seed,
        )
        settings.check_vocabulary(vocab_size)
        return settings
    except OptionError as exc:
        param = API_NAMES.get(exc.param, exc.param)
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
    max_tokens_param: str = "max_tokens",
) -> GenerationRequest:
    """The engine request for a validated API request whose prompt is ``prompt_ids``."""
    if fields.n != 1:
        raise bad_request("n > 1 is not supported: send one request per completion", param="n")
    stops = fields.stop_strings()
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    budget = completion_budget(len(prompt_ids), max_tokens, served, prompt_param, max_tokens_param)
    return GenerationRequest(
        prompt_ids=prompt_ids,
        max_tokens=max(budget, 1),  # 0 (a completion scoring its prompt): the engine's one token is dropped
        sampling=sampling_of(fields, served.vocab_size, served.tokenizer.sampling_defaults),
        stop=tuple(stops),
        logprobs=logprobs,
        constraint=constraint,
        fit_budget=max_tokens is None,  # the rest of the context, or what the KV budget holds
        adapters=adapter_weights(fields, served),
    )


def adapter_weights(fields: SamplingFields, served: ServedModel) -> tuple[float, ...] | None:
    """The request's weight on each adapter: its ``lora`` entries (by position or name) and the
    one its model name picks (``BASE:NAME``, scale 1); None for the base model."""
    named, bank = served.adapter_named(fields.model), served.adapters
    if not fields.lora and named is None:
        return None
    if bank is None:
        raise bad_request("this server has no adapters to choose (serve --lora NAME=DIR)", param="lora")
    picks = []
    for pick in fields.lora or ():
        if isinstance(pick.id, int) and not 0 <= pick.id < len(bank.names):
            raise bad_request(f"lora id {pick.id} is not an adapter (0..{len(bank.names) - 1})", param="lora")
        if isinstance(pick.id, str) and pick.id not in bank.names:
            raise bad_request(f"lora id {pick.id!r} names no adapter ({', '.join(bank.names)})", param="lora")
        picks.append((pick.id if isinstance(pick.id, int) else bank.index(pick.id), pick.scale))
    if named is not None and all(index != bank.index(named) for index, _ in picks):
        picks.append((bank.index(named), 1.0))
    try:
        weights = tuple(bank.vector(picks))
    except MlxformerError as exc:
        raise bad_request(str(exc), param="lora") from exc
    return weights if any(weights) else None
