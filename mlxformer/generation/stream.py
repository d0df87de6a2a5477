"""Single-stream generation: ``decode`` drives one ``DecodingState`` (chunked ``prefill``, then
pipelined decode steps or speculation rounds), and ``stream_generate``/``generate`` turn what it
hands out into responses."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import mlx.core as mx

from mlxformer.cache import Cache, CacheSettings
from mlxformer.constrained import make_constraint
from mlxformer.generation.decoding import DecodingState, open_sequence
from mlxformer.errors import MlxformerError
from mlxformer.models.decoder import Model
from mlxformer.sampling.options import SamplingSettings, checked, sampling_with  # noqa: F401 (re-exported)
from mlxformer.sampling.samplers import TokenConstraint
from mlxformer.speculative.speculator import SpeculativeSettings, check_draft
from mlxformer.generation.steps import decode_step, default_prefill_step, prefill  # noqa: F401 (re-exported)
from mlxformer.text.tokenizer import Tokenizer


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
    incomplete: bool = False  # structured output cut short by max_tokens or a stop string (last response)


def decode(model: Model, state: DecodingState, prefill_step_size: int | None = None) -> Iterator[tuple[int, str]]:
    """Drive ``state`` on one stream until it finishes, yielding each ``(token, text piece)`` as it
    is recorded; the state is settled (its cache holds exactly its tokens but the last) at the end."""
    logits = prefill(model, mx.array(state.tokens[state.cache_offset :]), state.cache, prefill_step_size)
    try:
        if state.speculator is None:
            yield from _pipelined(model, state, logits)
        else:
            yield from _speculative(model, state, logits)
    finally:
        state.settle()


def _pipelined(model: Model, state: DecodingState, logits: mx.array) -> Iterator[tuple[int, str]]:
    """One token per step; step n+1's forward pass is queued (``mx.async_eval``) before token n
    is handed out, so the device never waits on Python. Under a constraint, the mask for step
    n+1 needs token n: it is computed while the device runs that forward pass."""
    constrained = state.constraint is not None
    if constrained:
        mx.async_eval(logits)
    token, _ = state.choose(logits)
    mx.async_eval(token)
    while True:
        more = state.room > 1
        if more:
            logits = decode_step(model, token, state.cache)
            if constrained:
                mx.async_eval(logits)
            else:
                next_token, _ = state.choose(logits, pending=token)
                mx.async_eval(next_token)
        value = int(token.item())
        text = state.record(value)
        yield value, text
        if state.finished:
            return
        if constrained:
            next_token, _ = state.choose(logits)
            mx.async_eval(next_token)
        token = next_token


def _speculative(model: Model, state: DecodingState, logits: mx.array) -> Iterator[tuple[int, str]]:
    """Speculation rounds: the proposals after the last token are verified in one forward pass of
    ``k + 1`` positions, and the round's tokens read in one host sync; without proposals, a
    plain decode step."""
    tokens = [int(state.choose(logits)[0].item())]
    while True:
        for value in tokens:
            yield value, state.record(value)
            if state.finished:
                return
        state.settle()
        proposed = state.propose()
        if proposed is not None:
            inputs = mx.concatenate([mx.array([state.last_token], mx.int32), proposed])[None]  # (1, k + 1)
            logits = model(inputs, state.cache)[0]  # (k + 1, vocab)
            tokens, _ = state.verify(logits)
        else:
            tokens = [int(state.choose(decode_step(model, mx.array([state.last_token]), state.cache))[0].item())]


def _peak_memory_gb() -> float:
    return mx.get_peak_memory() / 1e9


def responses(state: DecodingState, tokens: Iterator[tuple[int, str]]) -> Iterator[GenerationResponse]:
    """``GenerationResponse``s with running statistics for the ``(token, text)`` pairs that
    ``decode`` yields for ``state``."""
    mx.reset_peak_memory()
    start = decode_start = time.perf_counter()
    prompt_tokens = state.prompt_length - state.cache_offset
    prompt_tps = generation_tps = 0.0
    for n, (token, text) in enumerate(tokens, start=1):
        now = time.perf_counter()
        if n == 1:
            prompt_tps = prompt_tokens / max(now - start, 1e-9)
            decode_start = now
        else:
            generation_tps = (n - 1) / max(now - decode_start, 1e-9)
        stats = state.speculator.stats if state.speculator is not None else None
        yield GenerationResponse(
            text, token, prompt_tokens=state.prompt_length, prompt_tps=prompt_tps, generation_tokens=n,
            generation_tps=generation_tps, peak_memory_gb=_peak_memory_gb(), finish_reason=state.finish_reason,
            proposed_tokens=stats.proposed if stats else 0, accepted_tokens=stats.accepted if stats else 0,
            incomplete=state.incomplete,
        )


def stream_generate(
    model: Model,
    tokenizer: Tokenizer,
    prompt: str | Sequence[int],
    max_tokens: int = 256,
    *,
    sampling: SamplingSettings = SamplingSettings(),
    stop: Sequence[str] = (),
    cache: list[Cache] | None = None,
    cache_settings: CacheSettings | None = None,
    prefill_step_size: int | None = None,
    speculative: SpeculativeSettings | None = None,
    response_format: dict[str, Any] | None = None,
    regex: str | None = None,
    grammar: str | None = None,
    constraint: TokenConstraint | None = None,
    **sampling_kwargs: Any,
) -> Iterator[GenerationResponse]:
    """Stream a completion of ``prompt`` (raw text or token ids; no chat template is applied).

    Sampling may be given as ``sampling=SamplingSettings(...)`` or as its fields as keywords
    (``temp``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``presence_penalty``,
    ``frequency_penalty``, ``logit_bias``, ``seed``; see ``mlxformer.sampling.options``). ``cache``:
    caches that already hold the first ``cache[0].offset`` tokens of ``prompt`` (an earlier
    turn; only the rest is prefilled); otherwise a new one is made from ``cache_settings``.
    ``speculative`` turns on prompt-lookup or draft-model decoding (same greedy output).
    Each response carries the new text piece and token; the last one has ``finish_reason`` set.

    Structured output: ``response_format`` (a JSON Schema, or ``{"type": "json_object"}``),
    ``regex`` or ``grammar`` (Lark or GBNF) constrain the text; it then ends with ``"stop"`` once
    complete, or ``"length"`` if ``max_tokens`` cut it short. A prebuilt ``constraint``
    (``mlxformer.constrained.make_constraint``) may be passed instead.
    """
    if sampling_kwargs:
        sampling = sampling_with(sampling, sampling_kwargs)
    if response_format is not None or regex is not None or grammar is not None:
        if constraint is not None:
            raise MlxformerError("give either constraint or response_format/regex/grammar")
        constraint = make_constraint(
            tokenizer, model.args.vocab_size, response_format=response_format, regex=regex, grammar=grammar
        )
    if checked("speculative", speculative, SpeculativeSettings) is not None:
        check_draft(speculative, tokenizer)
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt  # (ids checked by open_sequence)
    state = open_sequence(
        model, ids, eos_ids=tokenizer.eos_token_ids, detokenizer=tokenizer.detokenizer(), sampling=sampling,
        max_tokens=max_tokens, stop=stop, cache=cache, cache_settings=cache_settings, speculative=speculative,
        constraint=constraint,
    )
    yield from responses(state, decode(model, state, prefill_step_size))


def generate(
    model: Model,
    tokenizer: Tokenizer,
    prompt: str | Sequence[int],
    max_tokens: int = 256,
    **kwargs: Any,
) -> str:
    """The whole completion of ``prompt`` as one string (see ``stream_generate`` for options)."""
    return "".join(response.text for response in stream_generate(model, tokenizer, prompt, max_tokens, **kwargs))
