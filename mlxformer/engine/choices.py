"""A step's chosen tokens as the engine hands them out: groups of rows chosen in one graph
(``Choice``), the log-probabilities their requests ask for, and one host read per group."""

from __future__ import annotations

from typing import Iterator

import mlx.core as mx

from mlxformer.engine.sequence import Sequence
from mlxformer.sampling import top_logprobs

# Rows chosen in one graph: their sequences (one per row; a sequence may have several rows, in
# order: a speculation round), the tokens (n,) and the log-probabilities (n, vocab).
Choice = tuple[list[Sequence], mx.array, mx.array]
# A choice with what its requests report: the chosen tokens' log-probabilities (n,) and the
# ``top`` alternatives' ids and values (n, top), each None when no row asks.
Picked = tuple[list[Sequence], mx.array, mx.array | None, mx.array | None, mx.array | None]


def with_logprobs(choice: Choice) -> Picked:
    """``choice`` with the log-probabilities its requests ask for (lazy; the largest ``top`` of
    the rows, by ``argpartition``)."""
    sequences, tokens, logprobs = choice
    asked = [s.request.logprobs for s in sequences]
    top = max((k for k in asked if k), default=0)
    chosen = None
    if any(k is not None for k in asked):
        chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]  # (n,)
    top_ids, top_values = top_logprobs(logprobs, top) if top else (None, None)  # (n, top)
    return sequences, tokens, chosen, top_ids, top_values


def arrays(picked: Picked) -> list[mx.array]:
    """The arrays to evaluate for ``picked``."""
    return [x for x in picked[1:] if x is not None]


def each_row(picked: Picked) -> Iterator[tuple[Sequence, int, float | None, list[tuple[int, float]] | None]]:
    """Each row of an evaluated ``picked``: its sequence, token, log-probability and top
    alternatives, as its request asks (one ``tolist`` per array)."""
    sequences, tokens, chosen, top_ids, top_values = picked
    values = chosen.tolist() if chosen is not None else None
    ids, tops = (top_ids.tolist(), top_values.tolist()) if top_ids is not None and top_values is not None else ([], [])
    for row, (sequence, token) in enumerate(zip(sequences, tokens.tolist())):
        k = sequence.request.logprobs
        top = None if k is None else list(zip(ids[row][:k], tops[row][:k])) if k else []
        yield sequence, int(token), values[row] if values is not None and k is not None else None, top
