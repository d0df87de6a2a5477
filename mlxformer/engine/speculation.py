"""Speculative decoding in the engine, one sequence at a time.

A speculating sequence has its own proposer (prompt lookup, or a draft model with its own
cache). When it has proposals, it is verified by its own forward pass of ``k + 1`` tokens over
its own caches (every position's logits kept), outside the batched ``(B, 1)`` decode step; the
decision is ``mlxformer.speculative.verify`` with the sequence's processors and PRNG keys. Once
its tokens are recorded (a stop may end it within the round), its caches are rewound to hold
exactly its tokens but the last, as after a plain decode step. Without proposals it simply
joins the batched decode step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from mlxformer.cache import Cache
from mlxformer.sampling import Distribution, LogitsProcessor
from mlxformer.speculative import (
    AdaptiveLength, KeySource, Proposer, SpeculativeStats, apply_processors, rewind, verify,
)


@dataclass
class Round:
    """One speculation round in flight: the proposals, then the verification's outcome."""

    proposed: list[int]
    draft_probs: mx.array | None  # (k, vocab), None for point-mass proposals
    accepted: int = 0
    next_token: int = -1


class Speculator:
    """One sequence's speculation: proposer, adaptive proposal length, statistics, current round."""

    def __init__(
        self,
        proposer: Proposer,
        limit: int,
        distribution: Distribution | None,
        processors: Sequence[LogitsProcessor],
        next_key: KeySource,
    ) -> None:
        self.proposer = proposer
        self.length = AdaptiveLength(limit)
        self.distribution = distribution  # None: greedy
        self.processors = processors
        self.next_key = next_key
        self.stats = SpeculativeStats()
        self.round: Round | None = None

    def propose(self, history: list[int], room: int) -> list[int]:
        """Proposals to follow ``history`` (at most ``room - 1``, so that the round's tokens fit in
        ``room``); starts a round when there are any."""
        k = min(self.length.current, room - 1)
        if k <= 0:
            return []
        proposed, draft_probs = self.proposer.propose(history, k)
        if proposed:
            self.round = Round(list(proposed), draft_probs)
        return list(proposed)

    def verify(self, logits: mx.array, history: list[int]) -> list[tuple[mx.array, mx.array]]:
        """Decide the round from the target's ``logits`` ``(k + 1, vocab)``: the accepted proposals
        then the next token, each as ``(token (1,), log-probabilities (1, vocab))`` (the
        distribution after the processors, lazy) in order."""
        assert self.round is not None
        proposed = self.round.proposed
        accepted, next_token = verify(
            logits, history, proposed, self.round.draft_probs, self.distribution, self.processors, self.next_key
        )
        self.round.accepted, self.round.next_token = accepted, next_token
        self.length.update(accepted, len(proposed))
        self.stats.proposed += len(proposed)
        self.stats.accepted += accepted
        self.stats.rounds += 1
        choices = []
        for i, token in enumerate([*proposed[:accepted], next_token]):
            row = apply_processors(logits[i : i + 1], history + proposed[:i], self.processors)  # (1, vocab)
            choices.append((mx.array([token]), row - mx.logsumexp(row, axis=-1, keepdims=True)))
        return choices

    def settle(self, cache: Sequence[Cache], tokens: list[int], finished: bool) -> None:
        """After this step's tokens were recorded (``tokens``: prompt and generated): rewind the
        caches to hold ``tokens[:-1]`` and, unless ``finished``, tell the proposer what was kept."""
        rewind(cache, int(cache[0].offset) - (len(tokens) - 1))
        round, self.round = self.round, None
        if finished:
            return
        if round is None:  # a plain token (prompt's end or the batched decode step)
            self.proposer.verified(0, [], tokens[-1])
        else:
            self.proposer.verified(round.accepted, round.proposed, round.next_token)
