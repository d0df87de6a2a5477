"""One sequence's decoding state, the object every generation loop drives.

``DecodingState`` holds a sequence's token history (prompt, cached prefix included, then the
generated tokens), its per-layer caches, its sampling settings, its PRNG state, its
constraint, its stop matcher and detokenizer, and its speculation (a ``Speculator`` whose
proposer sees the whole history). Its invariant, kept by ``settle`` after every step: the
cache holds exactly ``tokens[:-1]``, every token handed out but the last (one that a
pipelined decode step already fed may stay if the cache cannot take it back). So a stop inside
a speculation round, or past the last token, never leaves stray keys in the cache, and what
the cache holds (``cache_tokens``) can be reused by the next turn or the prefix cache.

The loops that drive it: ``mlxformer.generation.stream.decode`` (one stream: ``stream_generate``,
``ChatSession``, ``bench``, distributed generation) and the engine (one state per request,
batched by its runner). ``open_sequence`` builds a state for one stream.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Iterable, Sequence

import mlx.core as mx

from mlxformer.cache import Cache, CacheSettings, make_cache
from mlxformer.errors import MlxformerError, OptionError
from mlxformer.models.decoder import Model
from mlxformer.sampling.options import SamplingSettings, check_integer, check_strings, checked, checked_sampling
from mlxformer.sampling.choosing import History, ChoiceRow, choose, draw_key
from mlxformer.sampling.samplers import TokenConstraint, make_distribution
from mlxformer.speculative.speculator import Proposer, SpeculativeSettings, Speculator, new_proposer, rewind
from mlxformer.text.stop import StopMatcher
from mlxformer.text.tokenizer import StreamingDetokenizer


def with_rewind(settings: CacheSettings | None, speculative: SpeculativeSettings | None) -> CacheSettings | None:
    """``settings`` with the rewind slack speculation needs (rotating caches keep that many
    tokens beyond their window so that a rejected round can be taken back)."""
    if speculative is None:
        return settings
    return dataclasses.replace(settings or CacheSettings(), rewind=speculative.num_draft_tokens)


def reserve_rewind(cache: Sequence[Cache], speculative: SpeculativeSettings | None) -> None:
    """Give existing caches (e.g. loaded from a prompt-cache file) the rewind slack of ``with_rewind``."""
    if speculative is None:
        return
    for layer_cache in cache:
        layer_cache.reserve_rewind(speculative.num_draft_tokens)


class DecodingState:
    """A sequence being decoded: see the module docstring.

    ``prompt``: every token before the first generated one (a prefix of them may already be in
    the ``cache``: ``cache[0].offset`` of them). ``eos_ids`` end it with "stop", as do the
    ``stop`` strings, and a ``constraint`` once it is done; ``max_tokens`` ends it with "length".
    Without a ``detokenizer`` no text is made (and stop strings cannot match).
    """

    def __init__(
        self,
        prompt: Sequence[int],
        *,
        sampling: SamplingSettings = SamplingSettings(),
        max_tokens: int = 256,
        stop: Sequence[str] = (),
        eos_ids: Sequence[int] = (),
        detokenizer: StreamingDetokenizer | None = None,
        constraint: TokenConstraint | None = None,
        cache: list[Cache] | None = None,
    ) -> None:
        if not prompt:
            raise MlxformerError("empty prompt: nothing to generate from")
        check_integer("max_tokens", max_tokens, low=1)
        self.prompt = [int(t) for t in prompt]
        self.generated: list[int] = []  # (the engine's replay edits it in place)
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.seed = sampling.seeded().seed
        self.key = 0  # the PRNG state: how many draws the sequence made (``choosing.draw_key``)
        self.constraint = constraint
        self.detokenizer = detokenizer
        self.stops = StopMatcher(check_strings("stop", stop))  # one string: one stop, not its characters
        self.eos = set(eos_ids)
        self.speculator: Speculator | None = None
        self.cache = cache if cache is not None else []
        self.finish_reason: str | None = None
        self._counted: tuple[int, mx.array | None] = (0, None)  # ``_generated_counts``: tokens counted, counts

    @property
    def cache(self) -> list[Cache]:
        """The per-layer caches the sequence decodes on (the engine swaps them: batch views, a
        prefix-cache copy after preemption); a speculator's proposer follows them (native MTP)."""
        return self._cache

    @cache.setter
    def cache(self, value: list[Cache]) -> None:
        self._cache = value
        if self.speculator is not None:
            self.speculator.proposer.follow(value)

    # --- tokens -------------------------------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        """Prompt then generated tokens."""
        return self.prompt + self.generated

    @property
    def prompt_length(self) -> int:
        return len(self.prompt)

    @property
    def last_token(self) -> int:
        return self.generated[-1] if self.generated else self.prompt[-1]

    @property
    def cache_offset(self) -> int:
        """How many tokens the cache holds."""
        return int(self.cache[0].offset) if self.cache else 0  # type: ignore[arg-type]

    @property
    def cache_tokens(self) -> list[int]:
        """The tokens whose keys and values the cache holds."""
        return self.tokens[: self.cache_offset]

    @property
    def room(self) -> int:
        """Tokens still allowed before ``max_tokens``."""
        return self.max_tokens - len(self.generated)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def incomplete(self) -> bool:
        """Finished with its structured output cut short (by ``max_tokens`` or a stop string)."""
        return self.finished and self.constraint is not None and not self.constraint.done

    # --- choosing -----------------------------------------------------------------------

    @property
    def greedy(self) -> bool:
        return self.sampling.greedy

    def next_key(self) -> mx.array:
        """A fresh key ``(2,)`` from the sequence's own PRNG stream (``choosing.draw_key``)."""
        key = mx.array(draw_key(self.seed, self.key), mx.uint32)  # type: ignore[arg-type]
        self.key += 1
        return key

    def choice_row(self, pending: int = 0, vocab: int | None = None) -> ChoiceRow:
        """This sequence as a row of a batch choice (a draw taken from its stream unless it is
        greedy; its constraint's mask computed); ``pending``: tokens chosen after its history but
        not yet recorded (``choosing.process``). Host work independent of the context: the
        history is a view, and with ``vocab`` the generated tokens' counts are kept running."""
        key = None
        if not self.greedy:
            key = draw_key(self.seed, self.key)  # type: ignore[arg-type]
            self.key += 1
        mask = self.constraint.next_mask() if self.constraint is not None else None
        penalized = self.sampling.presence_penalty or self.sampling.frequency_penalty
        counts = self._generated_counts(vocab) if penalized and vocab is not None else None
        return ChoiceRow(self.sampling, History(self.prompt, self.generated), len(self.prompt), key, mask, pending, counts)

    def _generated_counts(self, vocab: int) -> mx.array:
        """Float32 ``(vocab,)`` counts of the generated tokens, on the device, updated with the
        tokens recorded since the last call (rebuilt when ``generated`` shrank: a replay)."""
        counted, counts = self._counted
        if counts is None or counted > len(self.generated) or counts.shape[0] != vocab:
            counted, counts = 0, mx.zeros((vocab,), mx.float32)
        if counted < len(self.generated):
            counts = counts.at[mx.array(self.generated[counted:])].add(1.0)
        self._counted = (len(self.generated), counts)
        return counts

    def choose(self, logits: mx.array, pending: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """Next token ``(1,)`` and the processed log-probabilities ``(1, vocab)`` from logits
        ``(1, vocab)``, lazily (``choosing.choose`` with a batch of one). ``pending``: a token
        ``(1,)`` already chosen but not yet recorded (a pipelined loop), which the penalties
        count as history."""
        return choose(logits, [self.choice_row(1 if pending is not None else 0, logits.shape[-1])], pending)

    # --- recording ----------------------------------------------------------------------

    def record(self, token: int) -> str:
        """Hand out ``token``: append it, advance the constraint, and return its text piece;
        ``finish``es the sequence when a stop condition is met."""
        if self.finished:
            raise MlxformerError("the sequence has already finished")
        self.generated.append(int(token))
        if self.constraint is not None:
            self.constraint.advance(token)
        if token in self.eos:
            self.finish("stop")
            return self._final()
        piece = self.detokenizer.add_token(token) if self.detokenizer is not None else ""
        text, stopped = self.stops.feed(piece)
        if stopped:
            self.finish("stop")
        elif self.constraint is not None and self.constraint.done:
            self.finish("stop")
            text += self._final()
        elif self.room <= 0:
            self.finish("length")
            text += self._final()
        return text

    def finish(self, reason: str) -> None:
        """End the sequence early (e.g. "cancelled", "error")."""
        self.finish_reason = reason

    def _final(self) -> str:
        """Text still held back: the detokenizer's tail, then the stop matcher's."""
        tail = self.detokenizer.finalize() if self.detokenizer is not None else ""
        piece, _ = self.stops.feed(tail)
        return piece + self.stops.flush()

    # --- speculation --------------------------------------------------------------------

    def speculate(self, settings: SpeculativeSettings, cache_settings: CacheSettings | None = None,
                  proposer: Proposer | None = None) -> None:
        """Decode speculatively: proposals from ``proposer`` (e.g. a chat's, kept across turns;
        default: a new one as ``settings`` ask, a draft model getting ``settings.draft_cache`` or
        what fits it of the target's ``cache_settings``), drawing from this sequence's stream."""
        if self.constraint is not None:
            raise MlxformerError("structured output is not supported with speculative decoding")
        s = self.sampling
        distribution = None if self.greedy else make_distribution(s.temp, s.top_p, s.top_k, s.min_p)
        if proposer is None:
            proposer = new_proposer(settings, cache_settings)
        proposer.bind(distribution, self.next_key)
        proposer.follow(self.cache)
        self.speculator = Speculator(proposer, settings.num_draft_tokens, s, len(self.prompt), self.next_key)

    def propose(self) -> mx.array | None:
        """This round's proposals ``(k,)``, maybe still on the device (None when not speculating
        or without a guess)."""
        if self.speculator is None:
            return None
        return self.speculator.propose(History(self.prompt, self.generated), self.room)

    def verify(self, logits: mx.array) -> tuple[list[int], mx.array]:
        """The round's outcome from the target's ``logits`` ``(k + 1, vocab)`` over the last
        token and the proposals: ``(token (1,), log-probabilities (1, vocab))`` to record in order."""
        assert self.speculator is not None
        return self.speculator.verify(logits, History(self.prompt, self.generated))

    def settle(self) -> None:
        """After a step's tokens were recorded: take back what the cache holds beyond
        ``tokens[:-1]`` (rejected or unused proposals; a token fed past a stop)."""
        if self.speculator is not None:
            self.speculator.round = None
        extra = self.cache_offset - (len(self.prompt) + len(self.generated) - 1)
        if extra <= 0 or not self.cache:
            return
        if self.speculator is not None or extra > 1:
            rewind(self.cache, extra)  # raises if the cache cannot
            return
        # One token fed by a pipelined decode step: taken back when the cache can (a rotating
        # cache without slack that evicted cannot; it then holds every token handed out).
        for layer_cache in self.cache:
            layer_cache.trim(1)
        if len({int(c.offset) for c in self.cache}) > 1:  # type: ignore[arg-type]
            raise MlxformerError("the cache layers disagree after a rewind")


def check_prompt_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """``ids`` as ints, each a token of a ``vocab_size`` vocabulary, else an ``OptionError``
    (an id outside it would index past the embedding table)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise OptionError("prompt", f"must be token ids (got {type(ids).__name__})")
    checked = []
    for token in ids:
        try:
            token = operator.index(token)
        except TypeError:
            raise OptionError("prompt", f"token ids must be integers, got {token!r}") from None
        if not 0 <= token < vocab_size:
            raise OptionError("prompt", f"token id {token} is outside the vocabulary (size {vocab_size})")
        checked.append(token)
    return checked


def open_sequence(
    model: Model,
    prompt: Sequence[int],
    *,
    eos_ids: Sequence[int],
    detokenizer: StreamingDetokenizer | None,
    sampling: SamplingSettings = SamplingSettings(),
    max_tokens: int = 256,
    stop: Sequence[str] = (),
    cache: list[Cache] | None = None,
    cache_settings: CacheSettings | None = None,
    speculative: SpeculativeSettings | None = None,
    proposer: Proposer | None = None,
    constraint: TokenConstraint | None = None,
) -> DecodingState:
    """A state ready for ``mlxformer.generation.stream.decode``: ``cache`` (holding a prefix of
    ``prompt``) or a new one from ``cache_settings``, with the rewind slack speculation needs."""
    checked_sampling(sampling).check_vocabulary(model.args.vocab_size)
    prompt = check_prompt_ids(prompt, model.args.vocab_size)
    checked("cache_settings", cache_settings, CacheSettings)
    checked("cache", cache, (list, tuple))
    if cache is None:
        cache = make_cache(model, with_rewind(cache_settings, speculative))
    else:
        reserve_rewind(cache, speculative)
    state = DecodingState(
        prompt, sampling=sampling, max_tokens=max_tokens, stop=stop, eos_ids=eos_ids, detokenizer=detokenizer,
        constraint=constraint, cache=cache,
    )
    model.args.check_positions(len(prompt), max_tokens)  # (max_tokens checked by the state)
    if state.cache_offset >= len(prompt):
        raise MlxformerError("the cache already holds the whole prompt: nothing is left to prefill")
    if speculative is not None:
        state.speculate(speculative, cache_settings, proposer)
    return state
