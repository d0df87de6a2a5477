"""One request's state in the engine: its tokens, cache, sampling, stop conditions and output."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence as Seq

import mlx.core as mx

from mlxformer.cache import Cache
from mlxformer.engine.prompt_scores import PromptScores
from mlxformer.engine.speculation import Speculator
from mlxformer.errors import MlxformerError
from mlxformer.options import SamplingSettings, check_integer
from mlxformer.speculative import SpeculativeStats
from mlxformer.sampling import TokenConstraint, make_logits_processors, make_sampler
from mlxformer.stop import StopMatcher
from mlxformer.tokenizer import StreamingDetokenizer


@dataclass
class GenerationRequest:
    """What to generate: prompt token ids and per-request settings.

    ``logprobs``: ``None`` reports none; ``k >= 0`` reports the chosen token's log-probability
    and the ``k`` most likely alternatives. ``sampling`` holds every sampling option (penalties
    and logit bias included; validated when made); ``constraint`` restricts the next tokens.
    """

    prompt_ids: list[int]
    max_tokens: int = 256
    sampling: SamplingSettings = SamplingSettings()
    stop: Seq[str] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # k >= 0: also score the prompt's tokens (k alternatives each)
    constraint: TokenConstraint | None = None
    speculate: bool = True  # decode speculatively when the engine has speculative settings (not with a constraint)


@dataclass
class TokenEvent:
    """One step of a request's output: a text piece and the token it came from.

    The last event has ``finish_reason`` set ("stop", "length" or "cancelled").
    """

    text: str
    token: int | None
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    proposed_tokens: int = 0  # speculative decoding: tokens proposed so far for this request
    accepted_tokens: int = 0  # ... and accepted by the model


class Status(enum.Enum):
    WAITING = "waiting"  # queued, not admitted
    PREFILLING = "prefilling"  # admitted, prompt partly processed
    RUNNING = "running"  # decoding
    FINISHED = "finished"


def check_request(request: GenerationRequest, vocab_size: int) -> None:
    """Raise ``MlxformerError`` on a request the engine cannot run."""
    if not request.prompt_ids:
        raise MlxformerError("empty prompt: nothing to generate from")
    if bad := [t for t in request.prompt_ids if not 0 <= t < vocab_size]:
        raise MlxformerError(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})")
    check_integer("max_tokens", request.max_tokens, low=1)
    request.sampling.check_vocabulary(vocab_size)
    if request.logprobs is not None:
        check_integer("logprobs", request.logprobs, low=0)
    if request.prompt_logprobs is not None:
        check_integer("prompt_logprobs", request.prompt_logprobs, low=0)


class Sequence:
    """A request being served: prompt, generated tokens, its own caches, sampler and matchers."""

    def __init__(self, request: GenerationRequest, detokenizer: StreamingDetokenizer, eos_ids: Seq[int]) -> None:
        self.request = request
        self.prompt = list(request.prompt_ids)
        self.generated: list[int] = []
        self.status = Status.WAITING
        self.cache: list[Cache] = []
        self.cached_tokens = 0  # prompt tokens reused from the prefix cache
        self.processed = 0  # prompt tokens already in the cache
        self.cancelled = False
        self.finish_reason: str | None = None
        s = request.sampling
        self.sampler = make_sampler(s.temp, s.top_p, s.top_k, s.min_p)
        self.greedy = s.temp == 0
        self.processors = make_logits_processors(s, len(self.prompt))
        self.seed = s.seeded().seed
        self.key: mx.array | None = None  # made on first use, in the engine's thread
        self.speculator: Speculator | None = None  # set at admission when the request speculates
        self.detokenizer = detokenizer
        self.stops = StopMatcher(request.stop)
        k = request.prompt_logprobs
        self.prompt_scores = PromptScores(self.prompt, k) if k is not None else None  # filled during prefill
        self.eos = set(eos_ids)

    # --- tokens -------------------------------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        """Prompt then generated tokens."""
        return self.prompt + self.generated

    @property
    def cache_tokens(self) -> list[int]:
        """The tokens whose keys/values the cache holds."""
        return self.tokens[: self.cache[0].offset] if self.cache else []  # type: ignore[index]

    @property
    def last_token(self) -> int:
        return self.generated[-1]

    # --- choosing the next token ----------------------------------------------------------

    def choose(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """Next token ``(1,)`` and the processed log-probabilities ``(1, vocab)`` from logits ``(1, vocab)``
        (lazy: the caller evaluates the whole batch at once)."""
        if self.processors:
            history = mx.array(self.tokens)
            for process in self.processors:
                logits = process(history, logits)
        constraint = self.request.constraint
        if constraint is not None and (allowed := constraint.next_mask()) is not None:
            vocab = logits.shape[-1]
            if allowed.shape[0] < vocab:
                allowed = mx.concatenate([allowed, mx.zeros((vocab - allowed.shape[0],), mx.bool_)])
            logits = mx.where(allowed[:vocab], logits, mx.array(-mx.inf, logits.dtype))
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.greedy:
            return mx.argmax(logprobs, axis=-1), logprobs
        return self.sampler(logprobs, self.next_key()), logprobs  # type: ignore[call-arg]

    def next_key(self) -> mx.array:
        """A fresh key from the sequence's own PRNG stream (``split(key(seed))``, as MLX's global
        stream after ``mx.random.seed(seed)``)."""
        if self.key is None:
            self.key = mx.random.key(self.seed)
        self.key, draw = mx.random.split(self.key)
        return draw

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing altering the logits: its row can be chosen together with others."""
        return self.greedy and not self.processors and self.request.constraint is None

    # --- output -------------------------------------------------------------------------

    def accept(self, token: int, logprob: float | None, top: list[tuple[int, float]] | None) -> TokenEvent:
        """Record the chosen ``token`` and return its event (finished when a stop condition hit)."""
        self.generated.append(token)
        if self.request.constraint is not None:
            self.request.constraint.advance(token)
        reason: str | None = None
        if token in self.eos:
            text, reason = self._final(), "stop"
        else:
            text, stopped = self.stops.feed(self.detokenizer.add_token(token))
            if stopped:
                reason = "stop"
            elif self.request.constraint is not None and self.request.constraint.done:
                text, reason = text + self._final(), "stop"
            elif len(self.generated) >= self.request.max_tokens:
                text, reason = text + self._final(), "length"
        if reason is not None:
            self.finish(reason)
        return self.event(text, token, logprob, top)

    def _final(self) -> str:
        """Text still held back: the detokenizer's tail, then the stop matcher's."""
        piece, _ = self.stops.feed(self.detokenizer.finalize())
        return piece + self.stops.flush()

    def finish(self, reason: str) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason

    def event(
        self, text: str, token: int | None, logprob: float | None = None, top: list[tuple[int, float]] | None = None
    ) -> TokenEvent:
        stats = self.speculative_stats or SpeculativeStats()
        return TokenEvent(
            text=text, token=token, logprob=logprob, top_logprobs=top, finish_reason=self.finish_reason,
            prompt_tokens=len(self.prompt), completion_tokens=len(self.generated), cached_tokens=self.cached_tokens,
            proposed_tokens=stats.proposed, accepted_tokens=stats.accepted,
        )

    @property
    def speculative_stats(self) -> SpeculativeStats | None:
        """Proposed and accepted tokens so far (None when the sequence does not speculate)."""
        return self.speculator.stats if self.speculator is not None else None


def choose_rows(sequences: Seq[Sequence], logits: mx.array) -> list[tuple[mx.array, mx.array]]:
    """Each sequence's next token ``(1,)`` and log-probabilities ``(1, vocab)`` from batch logits
    ``(B, vocab)`` (lazy). Plain greedy rows are normalized and arg-maxed in one batch op (each
    row's result is what it gets alone); the others go through their own processors and sampler."""
    if all(s.plain_greedy for s in sequences):
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tokens = mx.argmax(logprobs, axis=-1)
        return [(tokens[i : i + 1], logprobs[i : i + 1]) for i in range(len(sequences))]
    return [s.choose(logits[i : i + 1]) for i, s in enumerate(sequences)]
