"""Speculative decoding: propose several tokens cheaply, verify them in one target pass.

Decoding reads every weight once per token; verifying ``k`` proposed tokens in one forward
pass of ``k + 1`` positions costs little more, so every accepted proposal is nearly free.

- Proposers: ``PromptLookupProposer`` (the tokens that followed the last n-gram where it
  occurred earlier in the prompt or the output; no second model), ``DraftModelProposer``
  (a small model with the same tokenizer) and native MTP (``mlxformer.speculative.mtp``: the target's own
  multi-token-prediction head, fed the target's hidden states).
- Verification (``verify``, run by ``Speculator`` for one sequence's ``DecodingState``): greedy keeps the longest prefix of proposals that
  equals the target's argmax, so the output is token for token that of plain decoding. With
  sampling, the standard rejection rule (accept ``d`` with probability ``min(1, p(d)/q(d))``,
  else draw from ``max(p - q, 0)`` normalised) keeps the target's output distribution.
- After a rejection the caches are rewound with ``trim`` (``DecodingState.settle``); a cache
  that cannot rewind is an error. A draft model keeps its own cache in step with the history
  it is shown (trimming it back to the common prefix), so it may serve several turns.
- The proposal length adapts: one more after a round where everything was accepted, one
  fewer after a rejection, between 1 and ``num_draft_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol, Sequence

import mlx.core as mx

from mlxformer.cache.protocol import Cache
from mlxformer.errors import MlxformerError
from mlxformer.models.decoder import Model
from mlxformer.sampling.options import SamplingSettings, check_integer
from mlxformer.cache import CacheSettings, make_cache
from mlxformer.sampling.choosing import History, ChoiceRow, process
from mlxformer.sampling.samplers import Distribution, draw, filtered, normalize
from mlxformer.generation.steps import prefill
from mlxformer.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class SpeculativeSettings:
    """How to speculate: prompt lookup, a draft model (with its own cache settings) or MTP."""

    num_draft_tokens: int = 4  # the most tokens proposed per round
    prompt_lookup: bool = False
    draft_model: Model | None = None
    draft_tokenizer: Tokenizer | None = None  # must map ids exactly as the target's tokenizer
    mtp: "NativeDrafter | None" = None  # native MTP: the target's own multi-token-prediction head (``mlxformer.speculative.mtp``)
    draft_cache: CacheSettings | None = None  # the draft's KV cache (default: ``draft_cache_settings``)
    ngram_max: int = 3  # prompt lookup: longest suffix n-gram searched for
    # Shortest n-gram that may propose. A single recurring token is a weak cue: on SmolLM2
    # repeating a text, 2 took acceptance from 53% to 67% and decoding from 1.38x to 1.63x plain.
    ngram_min: int = 2

    def __post_init__(self) -> None:
        check_integer("num_draft_tokens", self.num_draft_tokens, low=1)
        if [self.prompt_lookup, self.draft_model is not None, self.mtp is not None].count(True) != 1:
            raise MlxformerError("speculative decoding needs exactly one of prompt lookup, a draft model or MTP")
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


class NativeDrafter(Protocol):
    """A target's own draft head as speculation sees it (``mlxformer.speculative.mtp.MTPDrafter``)."""

    @property
    def head(self) -> Any:
        """The draft head (its ``args`` size the draft's cache)."""
        ...

    def new_proposer(self, settings: CacheSettings | None) -> "Proposer":
        """A proposer over the head, its cache built with ``settings``."""
        ...


class Proposer(Protocol):
    """Something that guesses the next tokens."""

    def propose(self, history: Sequence[int], k: int) -> tuple[Sequence[int] | mx.array, mx.array | None]:
        """Up to ``k`` tokens to follow ``history`` (ids, or an int array ``(n,)`` left on the
        device until the round's one read), and their draft probabilities ``(n, vocab)``
        (``None`` when the proposal is deterministic: a point mass on each token)."""
        ...

    def read(self, proposed: list[int]) -> None:
        """The round's proposals as its verification read them on the host."""
        ...

    def bind(self, distribution: Distribution | None, next_key: KeySource | None) -> None:
        """Draw (where it samples) from ``distribution`` (None: greedy) with keys from ``next_key``:
        those of the sequence it proposes for now."""
        ...

    def follow(self, cache: Sequence[Cache]) -> None:
        """The target's caches of the sequence it proposes for (native MTP reads the hidden
        states of the forwards over them; the others ignore them)."""
        ...


@dataclass
class PromptLookupProposer:
    """Prompt-lookup (n-gram) proposals: find the most recent earlier occurrence of the last
    ``n`` tokens (longest ``n`` first) and propose the tokens that followed it.

    An index maps each n-gram to its latest start, updated with the tokens that arrived since
    the last call (rebuilt only when the history is not a continuation of the one indexed), so
    a round costs the new tokens, not a scan of the history."""

    ngram_max: int = 3
    ngram_min: int = 2
    indexed: int = 0  # tokens of the history indexed
    tail: list[int] = field(default_factory=list)  # its last ``ngram_max`` tokens (a continuation keeps them)
    starts: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> latest start indexed

    def _index(self, history: Sequence[int]) -> None:
        """Index every n-gram that ends before the last token of ``history``."""
        done = self.indexed
        if len(history) < done or history[done - len(self.tail) : done] != self.tail:
            done, self.starts = 0, {}
        self.indexed, self.tail = len(history), history[max(len(history) - self.ngram_max, 0) :]
        for n in range(self.ngram_min, self.ngram_max + 1):
            # starts s with s + n <= len - 1, not indexed before (those had s + n <= done - 1)
            for start in range(max(done - n, 0), len(history) - n):
                self.starts[tuple(history[start:start + n])] = start

    def propose(self, history: Sequence[int], k: int) -> tuple[list[int], mx.array | None]:
        self._index(history)
        for n in range(min(self.ngram_max, len(history) - 1), self.ngram_min - 1, -1):
            start = self.starts.get(tuple(history[-n:]))
            if start is not None:
                return list(history[start + n:start + n + k]), None
        return [], None

    def bind(self, distribution: Distribution | None, next_key: KeySource | None) -> None:
        return None  # deterministic

    def follow(self, cache: Sequence[Cache]) -> None:
        return None
    def read(self, proposed: list[int]) -> None:
        return None  # they came from the host


def same_vocabulary(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether two tokenizers map every id to the same token and share the eos ids."""
    if a.vocab_size != b.vocab_size or set(a.eos_token_ids) != set(b.eos_token_ids):
        return False
    return all(a.backend.id_to_token(i) == b.backend.id_to_token(i) for i in range(a.vocab_size))


@dataclass
class DraftModelProposer:
    """Proposals from a small draft model with its own KV cache, which holds ``seen``: each
    ``propose`` first trims it back to the longest prefix shared with the history (dropping
    rejected proposals, or an earlier turn's tail) and feeds the rest."""

    model: Model
    cache: list[Cache]
    settings: CacheSettings | None = None  # to rebuild the cache when it cannot be trimmed
    distribution: Distribution | None = None  # None: greedy proposals
    next_key: KeySource | None = None  # PRNG keys for sampled proposals (None: the global stream)
    seen: list[int] = field(default_factory=list)
    unread: mx.array | None = None  # the last round's proposals, until they are ``read``

    def bind(self, distribution: Distribution | None, next_key: KeySource | None) -> None:
        self.distribution, self.next_key = distribution, next_key

    def follow(self, cache: Sequence[Cache]) -> None:
        return None  # it runs on its own cache
    def read(self, proposed: list[int]) -> None:
        if self.unread is not None:
            self.seen.extend(proposed[:-1])  # the cache holds every proposal but the last
            self.unread = None

    def _sync(self, history: Sequence[int]) -> list[int]:
        """Trim the cache to its common prefix with ``history``; the tokens left to feed."""
        if self.unread is not None:  # a round that was never verified (e.g. its request ended)
            self.read(self.unread.tolist())
        keep = trim_to_common_prefix(self.cache, self.seen, history)
        if keep is None:  # e.g. a rotating cache past its slack
            self.cache, keep = make_cache(self.model, self.settings), 0
        self.seen = list(history)
        return list(history[keep:])

    def propose(self, history: Sequence[int], k: int) -> tuple[mx.array, mx.array | None]:
        # The draft tokens stay on the device, each fed lazily to the next step and to the
        # target's verification: the round's one host read is the verification's (``read``).
        tokens: list[mx.array] = []
        probs: list[mx.array] = []
        logits = prefill(self.model, mx.array(self._sync(history)), self.cache)  # (1, vocab)
        for i in range(k):
            token, p = draft_token(logits, self.distribution, self.next_key)
            if p is not None:
                probs.append(p)
            tokens.append(token)
            if i + 1 < k:
                logits = self.model.last_logits(token[None], self.cache)
        self.unread = mx.concatenate(tokens).astype(mx.int32)  # (k,)
        return self.unread, (mx.stack(probs) if probs else None)


def draft_token(logits: mx.array, distribution: Distribution | None, next_key: KeySource | None
                ) -> tuple[mx.array, mx.array | None]:
    """A draft's token ``(1,)`` from its logits ``(1, vocab)``: the argmax (``distribution``
    None), or a draw from ``distribution`` and then also the probabilities ``(vocab,)`` drawn from."""
    if distribution is None:
        return mx.argmax(logits, axis=-1), None
    p = distribution(logits)  # (1, vocab)
    key = _key(next_key)
    return draw(mx.log(p), key[None] if key is not None else None), p[0]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    shorter = min(len(a), len(b))
    if list(a[:shorter]) == list(b[:shorter]):  # one extends the other (each round's case): compared in C
        return shorter
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def trim_to_common_prefix(cache: Sequence[Cache], held: Sequence[int], wanted: Sequence[int]) -> int | None:
    """Trim ``cache`` (holding ``held``) to the longest prefix it shares with ``wanted``, leaving
    at least one token of ``wanted`` to feed; how many tokens it keeps, or None if it cannot
    trim (a rotating cache that already evicted them: make a new one)."""
    keep = min(common_prefix_length(held, wanted), len(wanted) - 1)
    drop = len(held) - keep
    if drop > 0 and any(c.trim(drop) != drop for c in cache):
        return None
    return keep


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


def verify(
    logits: mx.array,
    history: Sequence[int],
    proposed: mx.array,
    draft_probs: mx.array | None,
    sampling: SamplingSettings,
    prompt_length: int,
    next_key: KeySource | None = None,
    known: list[int] | None = None,
) -> tuple[list[int], mx.array, list[int]]:
    """Decide a round in one graph and one host read: the tokens to hand out (the accepted
    proposals, then the target's next token), the log-probabilities ``(n, vocab)`` each was
    chosen from (after the penalties; lazy) and the ``proposed`` ids ``(k,)`` as read
    (``known``: already on the host). The penalties take the proposals into each row's history
    where they are: on the host (``known``), or on the device (row ``i`` counts the first ``i``
    as pending tokens, ``choosing.process``), so a draft's round is one read too.

    ``logits`` is ``(k + 1, vocab)``: row ``i`` predicts the token after ``proposed[:i]``, and is
    penalised as the history it follows. Greedy keeps the proposals while they are the argmax.
    Sampling accepts proposal ``d`` with probability ``min(1, p(d)/q(d))`` (``q``: the draft's
    probabilities, a point mass without them) and after the first rejection draws from
    ``max(p - q, 0)`` normalised, or from ``p`` after the last proposal; every round takes
    ``2k + 1`` keys from ``next_key`` (default: MLX's global stream), whatever it decides.
    """
    k = proposed.shape[0]
    ids = proposed.astype(mx.int32)  # (k,)
    if known is not None:
        rows = [ChoiceRow(sampling, History(history, known[:i]), prompt_length) for i in range(k + 1)]
        logprobs = normalize(process(logits, rows))  # (k + 1, vocab)
    else:  # row i follows the history with proposals[:i]
        rows = [ChoiceRow(sampling, history, prompt_length, pending=i) for i in range(k + 1)]
        logprobs = normalize(process(logits, rows, mx.broadcast_to(ids[None], (k + 1, k))))  # (k + 1, vocab)
    if sampling.greedy:
        targets = mx.argmax(logprobs, axis=-1)  # (k + 1,)
        accepts = targets[:k] == ids
    else:
        p = mx.softmax(filtered(logprobs, sampling.temp, sampling.top_k, sampling.top_p, sampling.min_p), axis=-1)
        q = draft_probs if draft_probs is not None else mx.zeros((k, p.shape[-1])).at[mx.arange(k), ids].add(1.0)
        q = mx.concatenate([q.astype(mx.float32), mx.zeros((1, p.shape[-1]))])  # (k + 1, vocab): none after the last
        keys = [next_key() for _ in range(2 * k + 1)] if next_key is not None else None
        uniform = (mx.vmap(lambda key: mx.random.uniform(shape=(), key=key))(mx.stack(keys[:k])) if keys
                   else mx.random.uniform(shape=(k,)))
        chosen = mx.arange(k)
        p_d, q_d = p[chosen, ids], q[chosen, ids]  # (k,)
        accepts = uniform * q_d < p_d
        residual = mx.maximum(p - q, 0.0)
        targets = draw(mx.log(residual), mx.stack(keys[k:]) if keys else None)  # (k + 1,)
    accepted = mx.sum(mx.cumprod(accepts.astype(mx.int32)), keepdims=True) if k else mx.zeros((1,), mx.int32)
    read = mx.concatenate([accepted, ids, mx.take(targets, accepted).astype(mx.int32)]).tolist()  # the round's one host read
    n, ids_read = int(read[0]), [int(t) for t in read[1 : k + 1]]
    return [*ids_read[:n], int(read[k + 1])], logprobs[: n + 1], ids_read


@dataclass
class Round:
    """One speculation round in flight: the proposals awaiting verification."""

    proposed: mx.array  # (k,) int32
    draft_probs: mx.array | None  # (k, vocab), None for point-mass proposals
    known: list[int] | None = None  # the proposals, when they came from the host


class Speculator:
    """One sequence's speculation: proposer, adaptive proposal length, statistics, current round."""

    def __init__(
        self,
        proposer: Proposer,
        limit: int,
        sampling: SamplingSettings,
        prompt_length: int,
        next_key: KeySource,
    ) -> None:
        self.proposer = proposer
        self.length = AdaptiveLength(limit)
        self.sampling, self.prompt_length = sampling, prompt_length
        self.next_key = next_key
        self.stats = SpeculativeStats()
        self.round: Round | None = None

    def propose(self, history: Sequence[int], room: int) -> mx.array | None:
        """Proposals ``(k,)`` to follow ``history`` (at most ``room - 1``, so that the round's
        tokens fit in ``room``; maybe still on the device); starts a round when there are any."""
        k = min(self.length.current, room - 1)
        if k <= 0:
            return None
        proposed, draft_probs = self.proposer.propose(history, k)
        if not len(proposed):
            return None
        known = None if isinstance(proposed, mx.array) else list(proposed)
        self.round = Round(mx.array(proposed, mx.int32), draft_probs, known)
        return self.round.proposed

    def verify(self, logits: mx.array, history: Sequence[int]) -> tuple[list[int], mx.array]:
        """Decide the round from the target's ``logits`` ``(k + 1, vocab)`` (``verify``): the
        accepted proposals then the next token, and their log-probabilities ``(n, vocab)``."""
        assert self.round is not None
        tokens, logprobs, proposed = verify(logits, history, self.round.proposed, self.round.draft_probs,
                                            self.sampling, self.prompt_length, self.next_key, self.round.known)
        self.proposer.read(proposed)
        accepted = len(tokens) - 1
        self.length.update(accepted, len(proposed))
        self.stats.proposed += len(proposed)
        self.stats.accepted += accepted
        self.stats.rounds += 1
        return tokens, logprobs


def check_draft(settings: SpeculativeSettings, tokenizer: Tokenizer) -> None:
    """Refuse a draft model whose tokenizer differs from the target's ``tokenizer``."""
    if settings.draft_model is None:
        return
    if settings.draft_tokenizer is None or not same_vocabulary(tokenizer, settings.draft_tokenizer):
        raise MlxformerError("the draft model's tokenizer differs from the target's; use a draft of the same family")


def draft_cache_settings(settings: SpeculativeSettings, target: CacheSettings | None) -> CacheSettings | None:
    """The draft's cache settings: ``settings.draft_cache`` if given, else the target's where
    they fit the draft (KV quantization needs a head dim that its groups divide; otherwise the
    draft's cache stays float), with the rewind slack of a round."""
    chosen = settings.draft_cache
    if chosen is None and target is not None:
        chosen = target
        draft = settings.draft_model or (settings.mtp.head if settings.mtp is not None else None)
        head_dim = draft.args.head_dim if draft is not None else 0
        if target.kv_bits is not None and head_dim % target.kv_group_size:
            chosen = replace(target, kv_bits=None)
    return replace(chosen or CacheSettings(), rewind=settings.num_draft_tokens)


def new_proposer(settings: SpeculativeSettings, cache_settings: CacheSettings | None = None) -> Proposer:
    """The proposer ``settings`` ask for (a draft model already accepted by ``check_draft``);
    ``cache_settings`` are the target's, from which the draft's default. ``bind`` it to a sequence."""
    if settings.mtp is not None:
        return settings.mtp.new_proposer(draft_cache_settings(settings, cache_settings))
    if settings.draft_model is None:
        return PromptLookupProposer(settings.ngram_max, settings.ngram_min)
    draft_settings = draft_cache_settings(settings, cache_settings)
    return DraftModelProposer(settings.draft_model, make_cache(settings.draft_model, draft_settings), draft_settings)
