"""One request in the engine: a ``DecodingState`` (tokens, cache, sampling, stop conditions,
speculation) plus its scheduling status and its events."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence


from mlxformer.generation.decoding import DecodingState, check_prompt_ids
from mlxformer.engine.prompt_scores import PromptScores
from mlxformer.errors import MlxformerError
from mlxformer.sampling.options import SamplingSettings, check_integer, checked_sampling
from mlxformer.sampling.samplers import TokenConstraint
from mlxformer.speculative.speculator import SpeculativeStats
from mlxformer.text.tokenizer import StreamingDetokenizer


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
    stop: Sequence[str] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # k >= 0: also score the prompt's tokens (k alternatives each)
    constraint: TokenConstraint | None = None
    speculate: bool = True  # decode speculatively when the engine has speculative settings (not with a constraint)
    # ``max_tokens`` is a default, not the client's (the rest of the context): under a KV budget
    # the engine cuts it to what the budget can hold for this prompt instead of refusing it
    fit_budget: bool = False
    adapters: tuple[float, ...] | None = None  # its weight on each of the model's adapters (None: the base model)


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
    incomplete: bool = False  # structured output cut short by max_tokens or a stop string (last event)

    @property
    def truncated(self) -> bool:
        """The output ended before it was complete: ``max_tokens`` ran out, or a stop string
        cut structured output short. The APIs report both as a length cut ("length",
        Responses' "incomplete", Anthropic's "max_tokens"), so clients treat a cut JSON reply
        as they treat one out of tokens."""
        return self.finish_reason == "length" or (self.finish_reason is not None and self.incomplete)

    @property
    def reported_finish_reason(self) -> str | None:
        """``finish_reason`` as the OpenAI-style APIs report it ("length" when ``truncated``)."""
        return "length" if self.truncated else self.finish_reason


class Status(enum.Enum):
    WAITING = "waiting"  # queued, not admitted
    PREFILLING = "prefilling"  # admitted, prompt partly processed
    RUNNING = "running"  # decoding
    FINISHED = "finished"


def check_request(request: GenerationRequest, vocab_size: int) -> None:
    """Raise ``MlxformerError`` on a request the engine cannot run (its sampling settings were
    checked when made; the prompt and ``max_tokens`` are checked by ``DecodingState``)."""
    check_prompt_ids(request.prompt_ids, vocab_size)
    checked_sampling(request.sampling).check_vocabulary(vocab_size)
    if request.logprobs is not None:
        check_integer("logprobs", request.logprobs, low=0)
    if request.prompt_logprobs is not None:
        check_integer("prompt_logprobs", request.prompt_logprobs, low=0)


class RequestState(DecodingState):
    """A request being served: its ``DecodingState`` plus where the engine is with it."""

    def __init__(self, request: GenerationRequest, detokenizer: StreamingDetokenizer, eos_ids: Sequence[int]) -> None:
        super().__init__(
            request.prompt_ids, sampling=request.sampling, max_tokens=request.max_tokens, stop=request.stop,
            eos_ids=eos_ids, detokenizer=detokenizer, constraint=request.constraint,
        )
        self.request = request
        self.status = Status.WAITING
        self.cached_tokens = 0  # prompt tokens reused from the prefix cache
        self.processed = 0  # prompt tokens already in the cache
        self.cancelled = False
        self.packs = True  # its prompt chunks (and rounds) share the step's forward (not after such a step failed)
        k = request.prompt_logprobs
        self.prompt_scores = PromptScores(self.prompt, k) if k is not None else None  # filled during prefill
        self.cache_salt = ""  # its prefix-cache keys' root: the adapters it runs with (``adapters.cache_salt``)

    def finish(self, reason: str) -> None:
        self.status = Status.FINISHED
        super().finish(reason)

    def event(
        self, text: str, token: int | None, logprob: float | None = None, top: list[tuple[int, float]] | None = None
    ) -> TokenEvent:
        stats = self.speculator.stats if self.speculator is not None else SpeculativeStats()
        return TokenEvent(
            text=text, token=token, logprob=logprob, top_logprobs=top, finish_reason=self.finish_reason,
            prompt_tokens=self.prompt_length, completion_tokens=len(self.generated), cached_tokens=self.cached_tokens,
            proposed_tokens=stats.proposed, accepted_tokens=stats.accepted, incomplete=self.incomplete,
        )

    @property
    def adapters(self) -> tuple[float, ...] | None:
        """Its weight on each adapter the model carries (``adapters.select``; None: the base model)."""
        return self.request.adapters
