"""Speculative decoding: propose several tokens cheaply, verify them in one target pass.

Decoding reads every weight once per token; verifying ``k`` proposed tokens in one forward
pass of ``k + 1`` positions costs little more, so every accepted proposal is nearly free.

- Proposers: ``PromptLookupProposer`` (the tokens that followed the last n-gram where it
  occurred earlier in the prompt or the output; no second model) and ``DraftModelProposer``
  (a small model with the same tokenizer).
- Verification (``speculative_tokens``): greedy keeps the longest prefix of proposals that
  equals the target's argmax, so the output is token for token that of plain decoding. With
  sampling, the standard rejection rule (accept ``d`` with probability ``min(1, p(d)/q(d))``,
  else draw from ``max(p - q, 0)`` normalised) keeps the target's output distribution.
- After a rejection the caches are rewound with ``trim``; a cache that cannot rewind is an error.
- The proposal length adapts: one more after a round where everything was accepted, one
  fewer after a rejection, between 1 and ``num_draft_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence

import mlx.core as mx

from mlxformer.cache.protocol import Cache
from mlxformer.errors import MlxformerError
from mlxformer.models.decoder import Model
from mlxformer.options import check_integer
from mlxformer.cache import CacheSettings, make_cache
from mlxformer.sampling import Distribution, LogitsProcessor
from mlxformer.steps import prefill
from mlxformer.tokenizer import Tokenizer


@dataclass(frozen=True)
class SpeculativeSettings:
    """How to speculate: prompt lookup, or a draft model (with its own cache settings)."""

    num_draft_tokens: int = 4  # the most tokens proposed per round
    prompt_lookup: bool = False
    draft_model: Model | None = None
    draft_tokenizer: Tokenizer | None = None  # must map ids exactly as the target's tokenizer
    ngram_max: int = 3  # prompt lookup: longest suffix n-gram searched for
    # Shortest n-gram that may propose. A single recurring token is a weak cue: on SmolLM2
    # repeating a text, 2 took acceptance from 53% to 67% and decoding from 1.38x to 1.63x plain.
    ngram_min: int = 2

    def __post_init__(self) -> None:
        check_integer("num_draft_tokens", self.num_draft_tokens, low=1)
        if self.prompt_lookup == (self.draft_model is not None):
            raise MlxformerError("speculative decoding needs exactly one of prompt lookup or a draft model")
        check_integer("ngram_min", self.ngram_min, low=1)
        check_integer("ngram_max", self.ngram_max, low=self.ngram_min)


@dataclass
class SpeculativeStats:
    """Proposed and accepted tokens so far."""

    proposed: int = 0
    accepted: int = 0
    rounds: int = 0

    @property
    def acceptance(self) -> float:
        """Accepted over proposed (0 before any proposal)."""
        return self.accepted / self.proposed if self.proposed else 0.0


KeySource = Callable[[], mx.array]  # returns a fresh PRNG key for each random draw


def _key(next_key: KeySource | None) -> mx.array | None:
    return next_key() if next_key is not None else None


class Proposer(Protocol):
    """Something that guesses the next tokens."""

    def propose(self, history: Sequence[int], k: int) -> tuple[list[int], mx.array | None]:
        """Up to ``k`` tokens to follow ``history``, and their draft probabilities ``(n, vocab)``
        (``None`` when the proposal is deterministic: a point mass on each token)."""
        ...

    def verified(self, accepted: int, proposed: Sequence[int], next_token: int) -> None:
        """``accepted`` leading proposals were kept, then ``next_token`` was chosen."""
        ...


@dataclass
class PromptLookupProposer:
    """Prompt-lookup (n-gram) proposals: find the most recent earlier occurrence of the last
    ``n`` tokens (longest ``n`` first) and propose the tokens that followed it."""

    ngram_max: int = 3
    ngram_min: int = 2

    def propose(self, history: Sequence[int], k: int) -> tuple[list[int], mx.array | None]:
        for n in range(min(self.ngram_max, len(history) - 1), self.ngram_min - 1, -1):
            tail = list(history[-n:])
            for start in range(len(history) - n - 1, -1, -1):
                if list(history[start:start + n]) == tail:
                    return list(history[start + n:start + n + k]), None
        return [], None

    def verified(self, accepted: int, proposed: Sequence[int], next_token: int) -> None:
        return None


def same_vocabulary(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether two tokenizers map every id to the same token and share the eos ids."""
    if a.vocab_size != b.vocab_size or set(a.eos_token_ids) != set(b.eos_token_ids):
        return False
    return all(a.backend.id_to_token(i) == b.backend.id_to_token(i) for i in range(a.vocab_size))


@dataclass
class DraftModelProposer:
    """Proposals from a small draft model with its own KV cache. ``pending`` holds the tokens
    the draft has not seen yet (the prompt at first, then the last verified tokens)."""

    model: Model
    cache: list[Cache]
    distribution: Distribution | None  # None: greedy proposals
    pending: list[int] = field(default_factory=list)
    next_key: KeySource | None = None  # PRNG keys for sampled proposals (None: the global stream)

    def propose(self, history: Sequence[int], k: int) -> tuple[list[int], mx.array | None]:
        tokens: list[int] = []
        probs: list[mx.array] = []
        logits = prefill(self.model, mx.array(self.pending), self.cache)  # (1, vocab)
        self.pending = []
        for i in range(k):
            if self.distribution is None:
                token = int(mx.argmax(logits, axis=-1).item())
            else:
                p = self.distribution(logits.astype(mx.float32))  # (1, vocab)
                token = int(mx.random.categorical(mx.log(p), axis=-1, key=_key(self.next_key)).item())
                probs.append(p[0])
            tokens.append(token)
            if i + 1 < k:
                logits = self.model.last_logits(mx.array([[token]]), self.cache)
        return tokens, (mx.stack(probs) if probs else None)

    def verified(self, accepted: int, proposed: Sequence[int], next_token: int) -> None:
        # The draft cache holds what it was fed plus proposals[:-1]: keep the accepted ones.
        if not proposed:
            self.pending.append(next_token)
        elif accepted < len(proposed):
            rewind(self.cache, len(proposed) - 1 - accepted)
            self.pending = [next_token]
        else:
            self.pending = [proposed[-1], next_token]


def rewind(cache: Sequence[Cache], n: int) -> None:
    """Forget the last ``n`` tokens of every layer's cache; raise if a cache cannot."""
    if n <= 0:
        return
    for layer_cache in cache:
        if layer_cache.trim(n) != n:
            raise MlxformerError(
                "speculative decoding needs a KV cache that can rewind; this cache cannot "
                "(a rotating --max-kv-size cache that has already evicted tokens)"
            )


@dataclass
class AdaptiveLength:
    """Proposal length: +1 after a fully accepted round, -1 after a rejection, in [1, limit]."""

    limit: int
    current: int = 0

    def __post_init__(self) -> None:
        self.current = self.current or self.limit

    def update(self, accepted: int, proposed: int) -> None:
        if proposed == 0:
            return
        step = 1 if accepted == proposed else -1
        self.current = max(1, min(self.limit, self.current + step))


def apply_processors(logits: mx.array, history: list[int], processors: Sequence[LogitsProcessor]) -> mx.array:
    """``logits`` ``(1, vocab)`` after each processor, given the tokens so far ``history``."""
    if not processors:
        return logits
    history_array = mx.array(history)
    for process in processors:
        logits = process(history_array, logits)
    return logits


def verify(
    logits: mx.array,
    history: list[int],
    proposed: list[int],
    draft_probs: mx.array | None,
    distribution: Distribution | None,
    processors: Sequence[LogitsProcessor],
    next_key: KeySource | None = None,
) -> tuple[int, int]:
    """Decide how many ``proposed`` tokens to keep and the token after them.

    ``logits`` is ``(k + 1, vocab)``: row ``i`` predicts the token after ``proposed[:i]``.
    Random draws use keys from ``next_key`` (default: MLX's global stream).
    Returns ``(accepted, next_token)``.
    """
    for i, token in enumerate([*proposed, None]):
        row = apply_processors(logits[i:i + 1], history + proposed[:i], processors)  # (1, vocab)
        if distribution is None:  # greedy: keep while the proposal is the argmax
            target = int(mx.argmax(row, axis=-1).item())
            if token != target:
                return i, target
            continue
        p = distribution(row)[0]  # (vocab,)
        if token is None:  # every proposal accepted: the bonus token
            return i, int(mx.random.categorical(mx.log(p), key=_key(next_key)).item())
        q = draft_probs[i] if draft_probs is not None else mx.zeros_like(p).at[token].add(1.0)
        if mx.random.uniform(key=_key(next_key)).item() * q[token].item() < p[token].item():  # accept w.p. min(1, p/q)
            continue
        residual = mx.maximum(p - q, 0.0)
        return i, int(mx.random.categorical(mx.log(residual / residual.sum()), key=_key(next_key)).item())
    raise AssertionError("unreachable")


def speculative_tokens(
    model: Model,
    prompt: mx.array,
    cache: Sequence[Cache],
    proposer: Proposer,
    distribution: Distribution | None,
    processors: Sequence[LogitsProcessor] = (),
    max_tokens: int = 256,
    num_draft_tokens: int = 4,
    stats: SpeculativeStats | None = None,
    prefill_step_size: int | None = None,
) -> Iterator[int]:
    """Yield up to ``max_tokens`` token ids, several per target pass where proposals hold.

    ``distribution`` is ``None`` for greedy decoding, else the sampling distribution
    (``mlxformer.sampling.make_distribution``); ``stats`` is updated as rounds complete.
    """
    stats = stats if stats is not None else SpeculativeStats()
    history = [int(t) for t in prompt.tolist()]
    logits = prefill(model, prompt, cache, prefill_step_size)  # (1, vocab)
    _, token = verify(logits, history, [], None, distribution, processors)
    proposer.verified(0, [], token)
    length = AdaptiveLength(num_draft_tokens)
    emitted = 0
    while True:
        yield token
        history.append(token)
        emitted += 1
        if emitted >= max_tokens:
            return
        k = min(length.current, max_tokens - emitted - 1)
        proposed, draft_probs = proposer.propose(history, k) if k > 0 else ([], None)
        logits = model(mx.array([[token, *proposed]]), cache)[0]  # (k + 1, vocab)
        accepted, token = verify(logits, history, proposed, draft_probs, distribution, processors)
        rewind(cache, len(proposed) - accepted)
        proposer.verified(accepted, proposed, token)
        if proposed:
            length.update(accepted, len(proposed))
            stats.proposed += len(proposed)
            stats.accepted += accepted
            stats.rounds += 1
        for accepted_token in proposed[:accepted]:
            yield accepted_token
            history.append(accepted_token)
            emitted += 1


def check_draft(settings: SpeculativeSettings, tokenizer: Tokenizer) -> None:
    """Refuse a draft model whose tokenizer differs from the target's ``tokenizer``."""
    if settings.draft_model is None:
        return
    if settings.draft_tokenizer is None or not same_vocabulary(tokenizer, settings.draft_tokenizer):
        raise MlxformerError("the draft model's tokenizer differs from the target's; use a draft of the same family")


def new_proposer(
    settings: SpeculativeSettings,
    prompt_ids: Sequence[int],
    distribution: Distribution | None,
    cache_settings: CacheSettings | None = None,
    next_key: KeySource | None = None,
) -> Proposer:
    """The proposer ``settings`` ask for (a draft model already accepted by ``check_draft``)."""
    if settings.draft_model is None:
        return PromptLookupProposer(settings.ngram_max, settings.ngram_min)
    cache = make_cache(settings.draft_model, cache_settings)
    return DraftModelProposer(settings.draft_model, cache, distribution, list(prompt_ids), next_key)


def make_proposer(
    settings: SpeculativeSettings,
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    distribution: Distribution | None,
    cache_settings: CacheSettings | None = None,
) -> Proposer:
    """The proposer ``settings`` ask for; a draft model's tokenizer must equal ``tokenizer``."""
    check_draft(settings, tokenizer)
    return new_proposer(settings, prompt_ids, distribution, cache_settings)
