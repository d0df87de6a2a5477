"""A step's chosen tokens as the engine hands them out: groups of rows chosen in one graph
(``choice``), the log-probabilities their requests ask for, and one host read for all groups."""

from __future__ import annotations

from typing import Iterator, NamedTuple

import mlx.core as mx

from mlxformer.engine.request_state import RequestState
from mlxformer.sampling.samplers import top_logprobs



class Picked(NamedTuple):
    """Rows chosen in one graph, with what their requests report (each None when no row asks)."""

    sequences: list[RequestState]  # one per row (a sequence may have several rows, in order: a speculation round)
    tokens: mx.array  # (n,)
    chosen: mx.array | None  # the chosen tokens' log-probabilities (n,)
    top_ids: mx.array | None  # the ``top`` alternatives' ids (n, top)
    top_values: mx.array | None  # and their log-probabilities (n, top)


def choice(sequences: list[RequestState], tokens: mx.array, logprobs: mx.array) -> Picked:
    """Rows chosen in one graph (``tokens (n,)`` from ``logprobs (n, vocab)``) with the
    log-probabilities their requests ask for (lazy; the largest ``top`` of the rows, by ``argpartition``)."""
    asked = [s.request.logprobs for s in sequences]
    top = max((k for k in asked if k), default=0)
    chosen = None
    if any(k is not None for k in asked):
        chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]  # (n,)
    top_ids, top_values = top_logprobs(logprobs, top) if top else (None, None)  # (n, top)
    return Picked(sequences, tokens, chosen, top_ids, top_values)


def arrays(picked: Picked) -> list[mx.array]:
    """The arrays to evaluate for ``picked``."""
    return [x for x in picked[1:] if x is not None]


def read(picks: list[Picked]) -> list[list[float]]:
    """Every array of ``picks`` read to the host in one sync (one ``tolist`` of their values as
    one float32 vector: token ids are exact in float32 below 2**24); each pick's values, flat."""
    parts = [x.astype(mx.float32).reshape(-1) for p in picks for x in arrays(p)]  # each (n * width,)
    if not parts:
        return [[] for _ in picks]
    values = mx.concatenate(parts).tolist()
    out, start = [], 0
    for p in picks:
        size = sum(x.size for x in arrays(p))
        out.append(values[start : start + size])
        start += size
    return out


def each_row(
    picked: Picked, values: list[float]
) -> Iterator[tuple[RequestState, int, float | None, list[tuple[int, float]] | None]]:
    """Each row of ``picked`` from its ``values`` (``read``): its sequence, token,
    log-probability and top alternatives, as its request asks."""
    sequences, tokens, chosen, top_ids, _ = picked
    n, top = len(sequences), top_ids.shape[1] if top_ids is not None else 0
    ids = values[n + (n if chosen is not None else 0):]  # (n * top) ids then (n * top) values
    for row, sequence in enumerate(sequences):
        k = sequence.request.logprobs
        lp = values[n + row] if chosen is not None and k is not None else None
        alternatives = [(int(ids[row * top + j]), ids[n * top + row * top + j]) for j in range(min(k, top))] if k else []
        yield sequence, int(values[row]), lp, None if k is None else alternatives


class Pipeline:
    """One step's choices queued (``mx.async_eval``) but not read yet: the next step feeds their
    tokens from the device, queues itself, then reads them (overlap: the device never waits on
    the host's handing out)."""

    def __init__(self, picked: list[Picked]) -> None:
        self.picked = picked
        tokens = [p.tokens.astype(mx.int32) for p in picked]
        self.tokens = tokens[0] if len(tokens) == 1 else mx.concatenate(tokens)  # (n,)
        self.where = {id(s): i for i, s in enumerate(s for p in picked for s in p.sequences)}  # one row each
        mx.async_eval([a for p in picked for a in arrays(p)])

    def __contains__(self, sequence: RequestState) -> bool:
        return id(sequence) in self.where

    def inputs(self, sequences: list[RequestState]) -> mx.array | None:
        """Each sequence's next input token ``(B,)``: its pending token, else its last one (from
        the host); None when none of them has one pending."""
        index = [self.where.get(id(s), -1) for s in sequences]
        if all(i < 0 for i in index):
            return None
        if index == list(range(self.tokens.shape[0])):
            return self.tokens
        taken = self.tokens[mx.array([max(i, 0) for i in index])]  # (B,)
        return mx.where(mx.array([i >= 0 for i in index]), taken, mx.array([s.last_token for s in sequences], mx.int32))
