"""The KV-cached generation loop: chunked ``prefill``, pipelined ``decode``, and the
``stream_generate``/``generate`` API that orchestrates them."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import mlx.core as mx

from mlxformer.cache import Cache, CacheSettings, make_cache
from mlxformer.constrained import make_constraint
from mlxformer.errors import MlxformerError
from mlxformer.models.decoder import Model
from mlxformer.options import SamplingSettings, check_integer
from mlxformer.sampling import (
    LogitsProcessor, Sampler, TokenConstraint, make_distribution, make_logits_processors, make_sampler,
)
from mlxformer.speculative import SpeculativeSettings, SpeculativeStats, make_proposer, speculative_tokens
from mlxformer.steps import decode_step, default_prefill_step, prefill  # noqa: F401 (re-exported)
from mlxformer.stop import StopMatcher
from mlxformer.tokenizer import StreamingDetokenizer, Tokenizer

@dataclass
class GenerationResponse:
    """One streamed step: the new text piece, its token, and running statistics."""

    text: str
    token: int | None
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory_gb: float
    finish_reason: str | None = None  # "stop" (eos or stop string), "length", or None while running
    proposed_tokens: int = 0  # speculative decoding: tokens proposed so far
    accepted_tokens: int = 0  # ... and accepted by the target


def _choose(
    logits: mx.array, history: mx.array, sampler: Sampler, processors: Sequence[LogitsProcessor],
    allowed: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    for process in processors:
        logits = process(history, logits)
    if allowed is not None:  # (vocab,) bool from a TokenConstraint
        logits = mx.where(allowed, logits, -float("inf"))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return sampler(logprobs), logprobs


def generate_tokens(
    model: Model,
    prompt: mx.array,
    cache: Sequence[Cache],
    sampler: Sampler,
    processors: Sequence[LogitsProcessor] = (),
    max_tokens: int = 256,
    prefill_step_size: int | None = None,
    constraint: TokenConstraint | None = None,
) -> Iterator[int]:
    """Yield up to ``max_tokens`` token ids; the next step is queued with ``mx.async_eval``
    before the current token is handed to the caller, so the device never waits on Python.

    With a ``constraint``, each token is sampled among the ones it allows and reported to it;
    generation ends when the constraint is ``done``."""
    if constraint is not None:
        yield from _constrained_tokens(model, prompt, cache, sampler, processors, max_tokens, prefill_step_size,
                                       constraint)
        return
    history = prompt
    token, _ = _choose(prefill(model, prompt, cache, prefill_step_size), history, sampler, processors)
    mx.async_eval(token)
    for n in range(max_tokens):
        if n + 1 < max_tokens:
            if processors:
                history = mx.concatenate([history, token])
            next_token, _ = _choose(decode_step(model, token, cache), history, sampler, processors)
            mx.async_eval(next_token)
        yield int(token.item())
        if n + 1 < max_tokens:
            token = next_token


def _constrained_tokens(
    model: Model,
    prompt: mx.array,
    cache: Sequence[Cache],
    sampler: Sampler,
    processors: Sequence[LogitsProcessor],
    max_tokens: int,
    prefill_step_size: int | None,
    constraint: TokenConstraint,
) -> Iterator[int]:
    """``generate_tokens`` under a constraint. Step n+1's forward pass is queued before token n is
    read (as without a constraint); its mask needs token n, so it is computed on the CPU while the
    device runs that forward pass, and only the sampling waits for it."""
    history = prompt
    logits = prefill(model, prompt, cache, prefill_step_size)
    mx.async_eval(logits)
    token, _ = _choose(logits, history, sampler, processors, constraint.next_mask())
    mx.async_eval(token)
    for n in range(max_tokens):
        more = n + 1 < max_tokens
        if more:
            if processors:
                history = mx.concatenate([history, token])
            logits = decode_step(model, token, cache)
            mx.async_eval(logits)
        value = int(token.item())
        constraint.advance(value)
        if not more or constraint.done:
            yield value
            return
        token, _ = _choose(logits, history, sampler, processors, constraint.next_mask())
        mx.async_eval(token)
        yield value


def _peak_memory_gb() -> float:
    return mx.get_peak_memory() / 1e9


def stream_generate(
    model: Model,
    tokenizer: Tokenizer,
    prompt: str | Sequence[int],
    max_tokens: int = 256,
    *,
    sampling: SamplingSettings = SamplingSettings(),
    stop: Sequence[str] = (),
    cache: Sequence[Cache] | None = None,
    cache_settings: CacheSettings | None = None,
    prefill_step_size: int | None = None,
    speculative: SpeculativeSettings | None = None,
    response_format: dict[str, Any] | None = None,
    regex: str | None = None,
    grammar: str | None = None,
    constraint: TokenConstraint | None = None,
    **sampling_kwargs: float | int | None,
) -> Iterator[GenerationResponse]:
    """Stream a completion of ``prompt`` (raw text or token ids; no chat template is applied).

    Sampling may be given as ``sampling=SamplingSettings(...)`` or as its fields as keywords
    (``temp``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``presence_penalty``,
    ``frequency_penalty``, ``logit_bias``, ``seed``; see ``mlxformer.options``). Pass a
    ``cache`` to continue from earlier turns; otherwise a new one is made from ``cache_settings``.
    ``speculative`` turns on prompt-lookup or draft-model decoding (same greedy output).
    Each response carries the new text piece and token; the last one has ``finish_reason`` set.

    Structured output: ``response_format`` (a JSON Schema, or ``{"type": "json_object"}``),
    ``regex`` or ``grammar`` (Lark or GBNF) constrain the text; it then ends with ``"stop"`` once
    complete, or ``"length"`` if ``max_tokens`` cut it short. A prebuilt ``constraint``
    (``mlxformer.constrained.make_constraint``) may be passed instead.
    """
    if sampling_kwargs:
        sampling = dataclasses.replace(sampling, **sampling_kwargs)
    if response_format is not None or regex is not None or grammar is not None:
        if constraint is not None:
            raise MlxformerError("give either constraint or response_format/regex/grammar")
        constraint = make_constraint(
            tokenizer, model.args.vocab_size, response_format=response_format, regex=regex, grammar=grammar
        )
    if constraint is not None and speculative is not None:
        raise MlxformerError("structured output is not supported with speculative decoding")
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise MlxformerError("empty prompt: nothing to generate from")
    check_integer("max_tokens", max_tokens, low=1)
    sampling.check_vocabulary(model.args.vocab_size)
    if sampling.seed is not None and sampling.seed != -1:
        mx.random.seed(sampling.seed)
    if speculative is not None:  # rotating caches keep enough beyond their window to rewind a round
        cache_settings = dataclasses.replace(cache_settings or CacheSettings(), rewind=speculative.num_draft_tokens)
    if cache is None:
        cache = make_cache(model, cache_settings)
    sampler = make_sampler(sampling.temp, sampling.top_p, sampling.top_k, sampling.min_p)
    processors = make_logits_processors(sampling, len(ids))
    eos = set(tokenizer.eos_token_ids)
    detokenizer = tokenizer.detokenizer()
    stops = StopMatcher(stop)

    mx.reset_peak_memory()
    start = time.perf_counter()
    prompt_tps = generation_tps = 0.0
    decode_start = start
    n = 0
    spec_stats = SpeculativeStats()
    if speculative is None:
        tokens = generate_tokens(
            model, mx.array(ids), cache, sampler, processors, max_tokens, prefill_step_size, constraint
        )
    else:
        distribution = make_distribution(sampling.temp, sampling.top_p, sampling.top_k, sampling.min_p) if sampling.temp > 0 else None
        proposer = make_proposer(speculative, tokenizer, ids, distribution, cache_settings)
        tokens = speculative_tokens(
            model, mx.array(ids), cache, proposer, distribution, processors, max_tokens,
            speculative.num_draft_tokens, spec_stats, prefill_step_size,
        )
    for n, token in enumerate(tokens, start=1):
        now = time.perf_counter()
        if n == 1:
            prompt_tps = len(ids) / max(now - start, 1e-9)
            decode_start = now
        else:
            generation_tps = (n - 1) / max(now - decode_start, 1e-9)
        stats = dict(
            prompt_tokens=len(ids), prompt_tps=prompt_tps, generation_tokens=n,
            generation_tps=generation_tps, peak_memory_gb=_peak_memory_gb(),
            proposed_tokens=spec_stats.proposed, accepted_tokens=spec_stats.accepted,
        )
        if token in eos:
            yield GenerationResponse(_final(detokenizer, stops), token, finish_reason="stop", **stats)
            return
        piece, stopped = stops.feed(detokenizer.add_token(token))
        if stopped or (constraint is not None and constraint.done):
            tail = "" if stopped else _final(detokenizer, stops)
            yield GenerationResponse(piece + tail, token, finish_reason="stop", **stats)
            return
        if n == max_tokens:
            yield GenerationResponse(piece + _final(detokenizer, stops), token, finish_reason="length", **stats)
            return
        yield GenerationResponse(piece, token, **stats)


def _final(detokenizer: StreamingDetokenizer, stops: StopMatcher) -> str:
    """Text still held back at the end: the detokenizer's tail, then the stop matcher's."""
    piece, _ = stops.feed(detokenizer.finalize())
    return piece + stops.flush()


def generate(
    model: Model,
    tokenizer: Tokenizer,
    prompt: str | Sequence[int],
    max_tokens: int = 256,
    **kwargs: Any,
) -> str:
    """The whole completion of ``prompt`` as one string (see ``stream_generate`` for options)."""
    return "".join(response.text for response in stream_generate(model, tokenizer, prompt, max_tokens, **kwargs))
