"""Runs the one decoder over a batch of sequences.

Prompt chunks and speculation rounds run on one sequence's own caches. Decoding sequences live
in ``DecodeBatch``es (``cache/batch.py``): their keys/values of each layer in one buffer, so a
decode step is one forward for all rows — one cache write and one attention per layer, each row
rotated at its own position and masked to its own slots (a model mixing sliding-window and
global layers, such as Gemma 2/3, keeps one slot layout per kind of layer). A sequence joins its
batch on its first decode step and leaves it (as per-sequence caches again) through ``release``.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import mlx.core as mx

from mlxformer.cache import Cache
from mlxformer.engine.prompt_scores import PromptScores
from mlxformer.cache.batch import BatchKey, DecodeBatch, batch_key, quantizes_next, row_quantizes_next
from mlxformer.models.decoder import Model


class Decoding(Protocol):
    """What the runner needs of a decoding sequence."""

    cache: list  # its per-layer caches (stand-ins while it is in a batch)
    speculator: object | None  # a speculating sequence decodes on its own caches

    @property
    def last_token(self) -> int: ...


class BatchRunner:
    """Turns the scheduled work into decoder calls: prompt chunks and batched decode steps."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.windows = [layer.window for layer in model.layers]
        # a layer whose row says when the keys turn quantized (an attention layer, not a recurrent one)
        self.kv_layer = next((i for i, layer in enumerate(model.layers) if not layer.recurrent), 0)
        self.batches: dict[BatchKey, DecodeBatch] = {}
        self._rows: dict[BatchKey, list[Decoding]] = {}  # each batch's sequences, in row order
        self._members: dict[int, BatchKey] = {}  # id(sequence) -> the batch it is in

    def prefill(
        self, tokens: Sequence[int], cache: Sequence[Cache], want_logits: bool, prompt_length: int | None = None,
        scores: PromptScores | None = None, start: int = 0,
    ) -> mx.array | None:
        """Run one prompt chunk through one sequence's caches; the last position's logits
        ``(1, vocab)`` when ``want_logits`` (lazy), else None (the cache is evaluated).
        ``prompt_length``: the whole prompt's (RoPE's dynamic base depends on it). ``scores``:
        every position's logits also score the prompt's tokens (the chunk starts at ``start``)."""
        inputs = mx.array(tokens)[None]  # (1, T)
        if scores is not None:
            hidden = self.model.hidden_states(inputs, cache, rope_length=prompt_length)
            logits = self.model.logits(hidden)[0]  # (1, T, vocab) -> (T, vocab)
            mx.eval([*scores.add(start, logits), *(c.state for c in cache)])  # on this (the engine's) thread
            return logits[-1:] if want_logits else None
        if want_logits:
            return self.model.last_logits(inputs, cache, rope_length=prompt_length)
        self.model.hidden_states(inputs, cache, rope_length=prompt_length)
        mx.eval([c.state for c in cache])
        return None

    def verify(self, tokens: Sequence[int], cache: Sequence[Cache]) -> mx.array:
        """A speculation round on one sequence's caches: the last token then the proposals in,
        every position's logits ``(T, vocab)`` out (lazy)."""
        return self.model(mx.array(tokens)[None], cache)[0]  # (1, T, vocab) -> (T, vocab)

    def decode(self, sequences: Sequence[Decoding]) -> mx.array:
        """One token per sequence in, next-token logits ``(B, vocab)`` in the same order out (lazy).

        Sequences not yet in a batch join one; one whose storage changes this step (a cache
        turning quantized) or that speculates runs on its own caches."""
        alone: list[Decoding] = []
        joining: dict[BatchKey, list[Decoding]] = {}
        for sequence in sequences:
            if id(sequence) in self._members and row_quantizes_next(sequence.cache[self.kv_layer].row):
                self.release(sequence)  # its storage turns quantized: it moves to the quantized batch
            if id(sequence) in self._members:
                continue
            if sequence.speculator is not None or any(quantizes_next(c) for c in sequence.cache):
                alone.append(sequence)
            else:
                joining.setdefault(batch_key(sequence.cache, self.windows), []).append(sequence)
        for kind, newcomers in joining.items():
            batch = self.batches.setdefault(kind, DecodeBatch(kind))
            for sequence, views in zip(newcomers, batch.join([s.cache for s in newcomers])):
                sequence.cache = views
                self._members[id(sequence)] = kind
            self._rows.setdefault(kind, []).extend(newcomers)
        parts: list[mx.array] = []
        order: list[int] = []  # id(sequence) of each row of the concatenated logits
        for kind, batch in self.batches.items():
            rows = self._rows.get(kind, [])
            if not rows:
                continue
            tokens = mx.array([s.last_token for s in rows])[:, None]  # (B, 1)
            parts.append(self.model.last_logits(tokens, batch.step_caches()))
            batch.commit()
            order += [id(s) for s in rows]
        for sequence in alone:
            parts.append(self.model.last_logits(mx.array([[sequence.last_token]]), sequence.cache))
            order.append(id(sequence))
        logits = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
        where = {key: i for i, key in enumerate(order)}
        wanted = [where[id(s)] for s in sequences]
        if wanted == list(range(len(order))):
            return logits
        return logits[mx.array(wanted)]

    def batched(self, sequence: Decoding) -> bool:
        """Whether ``sequence`` is in a batch (the KV budget counts its share of the buffers)."""
        return id(sequence) in self._members

    def release(self, sequence: Decoding) -> None:
        """Take ``sequence`` out of its batch, if it is in one: its ``cache`` becomes its own
        per-sequence caches again (call before reusing or keeping them)."""
        kind = self._members.pop(id(sequence), None)
        if kind is None:
            return
        rows = self._rows[kind]
        index = next(i for i, s in enumerate(rows) if s is sequence)
        rows.pop(index)
        sequence.cache = self.batches[kind].leave(index)

    def reset(self) -> None:
        """Forget every batch (after a failed step: the sequences in them have ended)."""
        self.batches.clear()
        self._rows.clear()
        self._members.clear()
