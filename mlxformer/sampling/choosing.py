"""Choosing the next token of every row of a batch in one graph.

Each row brings its settings, its history and its draw (``ChoiceRow``); ``choose`` turns the batch's
logits ``(B, vocab)`` into tokens ``(B,)`` and the log-probabilities they were chosen from
``(B, vocab)``. The rows' settings become ``(B,)`` vectors (penalty windows and logit biases
``(B, n)`` id matrices, constraint masks one ``(B, vocab)`` mask), greedy rows take the argmax
of the same graph through a ``where``, and the graph's size depends on which features the batch
uses, never on ``B`` (``tests/test_batch_step.py`` counts it). The single stream is a batch of one.

Randomness: a row's ``n``-th draw uses the key ``draw_key(seed, n)``, computed on the host from
the request's seed and its draw count, so a seeded request draws the same tokens alone or in any
batch, and a step that is rolled back only rewinds a counter. The noise is one Gumbel draw per
row from its own key (``sampling.draw``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from mlxformer.sampling.options import SamplingSettings
from mlxformer.sampling.samplers import (
    REPETITION_CONTEXT, draw, filtered, normalize, occurrence_penalized, repetition_penalized, token_counts,
)

_MASK64 = 2**64 - 1


def draw_key(seed: int, n: int) -> tuple[int, int]:
    """The PRNG key (two uint32 words) of draw ``n`` of the stream of ``seed``: splitmix64's
    ``n``-th output, a different 64-bit key per draw."""
    z = (seed + (n + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z >> 32, z & 0xFFFFFFFF


class History(Sequence[int]):
    """Token lists read as one (a prompt, its generated tokens, a round's proposals), without
    copying them: a row's history costs the host nothing per step, whatever the context (a
    slice copies only itself)."""

    def __init__(self, *parts: Sequence[int]) -> None:
        self.parts = parts

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts)

    def __iter__(self):
        for part in self.parts:
            yield from part

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return list(self)[index]
            out: list[int] = []
            for part in self.parts:
                if start < len(part) and stop > 0:
                    out += part[max(start, 0) : stop]
                start, stop = start - len(part), stop - len(part)
            return out
        index = index + len(self) if index < 0 else index
        for part in self.parts:
            if 0 <= index < len(part):
                return part[index]
            index -= len(part)
        raise IndexError("history index out of range")


@dataclass(frozen=True)
class ChoiceRow:
    """One row to choose for: its settings, every token so far (``history``, the generated ones
    from ``prompt_length`` on), its draw key (``None``: greedy) and its constraint's mask.
    ``counts``: how often each token occurs in the generated part, float32 ``(vocab,)``, kept
    running by the sequence (the presence/frequency penalties then read no history)."""

    sampling: SamplingSettings
    history: Sequence[int]
    prompt_length: int
    key: tuple[int, int] | None = None
    mask: mx.array | None = None  # bool (n,): the tokens allowed next
    pending: int = 0  # tokens chosen but not yet in ``history`` that follow it (its row of ``pending``)
    counts: mx.array | None = None


def _padded(rows: list[list[int]], fill: int) -> np.ndarray:
    """Ragged id lists as one ``(B, n)`` int32 matrix padded with ``fill``."""
    width = max((len(r) for r in rows), default=0)
    matrix = np.full((len(rows), width), fill, dtype=np.int32)
    for i, r in enumerate(rows):
        matrix[i, : len(r)] = r
    return matrix


def _ids(rows: list[list[int]], vocab: int, pending: mx.array | None, counts: list[int], window: int | None = None
         ) -> mx.array:
    """``rows`` as a padded ``(B, n)`` id array, then each row's first ``counts`` pending tokens
    (``(B, m)``; the last ``window`` of its history and them, when given; the rest padding)."""
    ids = mx.array(_padded(rows, vocab))
    if pending is None:
        return ids
    columns = np.arange(pending.shape[1])[None]  # (1, m)
    real = columns < np.array(counts)[:, None]  # (B, m)
    if window is not None:
        real &= columns >= np.array(counts)[:, None] - window
    return mx.concatenate([ids, mx.where(mx.array(real), pending.astype(mx.int32), vocab)], axis=1)


def _vector(values: list[float]) -> mx.array:
    return mx.array(values, mx.float32)


def process(logits: mx.array, rows: Sequence[ChoiceRow], pending: mx.array | None = None) -> mx.array:
    """Float32 logits ``(B, vocab)`` after each row's penalties, logit bias and constraint mask.
    ``pending``: tokens ``(B,)`` or ``(B, m)`` chosen but not yet in the histories (a pipelined
    loop; a speculation round's proposals), on the device: row ``b``'s history continues with
    its first ``rows[b].pending`` of them."""
    logits = logits.astype(mx.float32)
    vocab = logits.shape[-1]
    settings = [r.sampling for r in rows]
    if pending is not None and pending.ndim == 1:
        pending = pending[:, None]  # (B,) -> (B, 1)
    counts = [r.pending if pending is not None else 0 for r in rows]
    repetition = [s.repetition_penalty if s.repetition_penalty is not None else 1.0 for s in settings]
    if any(p != 1.0 for p in repetition):
        recent = [list(r.history[max(len(r.history) - REPETITION_CONTEXT + n, 0):]) if p != 1.0 else []
                  for r, p, n in zip(rows, repetition, counts)]
        counted = [n if p != 1.0 else 0 for p, n in zip(repetition, counts)]
        logits = repetition_penalized(logits, _ids(recent, vocab, pending, counted, REPETITION_CONTEXT), _vector(repetition))
    if any(s.presence_penalty or s.frequency_penalty for s in settings):
        logits = occurrence_penalized(logits, _generated_counts(rows, vocab, pending, counts),
                                      _vector([s.presence_penalty for s in settings]),
                                      _vector([s.frequency_penalty for s in settings]))
    if any(s.logit_bias for s in settings):
        biases = [dict(s.logit_bias or {}) for s in settings]
        ids = mx.array(_padded([list(b) for b in biases], vocab))  # (B, n)
        values = mx.array(np.array([list(b.values()) + [0.0] * (ids.shape[1] - len(b)) for b in biases], np.float32))
        bias = mx.zeros((len(rows), vocab + 1), mx.float32).at[mx.arange(len(rows))[:, None], ids].add(values)
        logits = logits + bias[:, :vocab]
    if any(r.mask is not None for r in rows):
        logits = mx.where(mask_matrix([r.mask for r in rows], vocab), logits, -mx.inf)
    return logits


def _generated_counts(rows: Sequence[ChoiceRow], vocab: int, pending: mx.array | None, counts: list[int]) -> mx.array:
    """Float32 ``(B, vocab)``: how often each token occurs in each row's generated tokens and
    its first ``counts`` pending ones (a row's running ``counts`` when it has them; zeros for a
    row without these penalties, whose weights are 0)."""
    unpenalized = [not (r.sampling.presence_penalty or r.sampling.frequency_penalty) for r in rows]
    if all(r.counts is not None or off for r, off in zip(rows, unpenalized)):
        zeros = mx.zeros((vocab,), mx.float32)
        total = mx.stack([r.counts if r.counts is not None else zeros for r in rows])
        if pending is None or not any(counts):
            return total
        return total + token_counts(_ids([[] for _ in rows], vocab, pending, counts), vocab)
    generated = [list(r.history[r.prompt_length:]) for r in rows]
    return token_counts(_ids(generated, vocab, pending, counts), vocab)


def mask_matrix(masks: Sequence[mx.array | None], vocab: int) -> mx.array:
    """Bool ``(B, vocab)`` of the allowed tokens (``None``: all; ids past a mask's end: none)."""
    full = mx.ones((vocab,), mx.bool_)
    rows = []
    for mask in masks:
        if mask is None:
            rows.append(full)
        elif mask.shape[0] < vocab:
            rows.append(mx.concatenate([mask, mx.zeros((vocab - mask.shape[0],), mx.bool_)]))
        else:
            rows.append(mask[:vocab])
    return mx.stack(rows)


def choose(logits: mx.array, rows: Sequence[ChoiceRow], pending: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """Next tokens ``(B,)`` and the processed log-probabilities ``(B, vocab)`` (float32) they
    were chosen from, lazily, for logits ``(B, vocab)`` of any dtype."""
    logprobs = normalize(process(logits, rows, pending))
    best = mx.argmax(logprobs, axis=-1)
    sampled = [r.key is not None and not r.sampling.greedy for r in rows]
    if not any(sampled):
        return best, logprobs
    settings = [r.sampling for r in rows]
    temp = _vector([1.0 if s.greedy else s.temp for s in settings])  # (B,)
    top_k = mx.array([min(s.top_k, logits.shape[-1]) for s in settings], mx.int32)
    top_p, min_p = _vector([s.top_p for s in settings]), _vector([s.min_p for s in settings])
    keys = mx.array([r.key if r.key is not None else (0, 0) for r in rows], mx.uint32)  # (B, 2)
    if any(s.top_k or s.top_p < 1.0 or s.min_p for s in settings):
        logits = filtered(logprobs, temp, top_k, top_p, min_p)
    else:  # temperature alone: no sort of the vocabulary
        logits = logprobs / temp[:, None]
    drawn = draw(logits, keys)
    if all(sampled):
        return drawn, logprobs
    return mx.where(mx.array(sampled), drawn, best), logprobs
