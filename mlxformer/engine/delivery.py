"""Handing out a step's tokens (``Delivery``): the sequences' choices built in one sampling graph
(``choose``), queued for the next step's one host read (``hand_out``: the overlap) or read now,
then recorded in each sequence and sent to its caller (``emit``); a sequence whose settings,
constraint or detokenizer fail ends alone."""

from __future__ import annotations

import mlx.core as mx

from mlxformer.engine.choices import Picked, Pipeline, arrays, choice, each_row, read
from mlxformer.engine.departures import Departures
from mlxformer.engine.parts import EngineParts
from mlxformer.engine.request_state import RequestState, Status, TokenEvent
from mlxformer.sampling.choosing import choose


class Delivery:
    """The chosen tokens on their way to the callers, and the step's tokens still in flight (``pipeline``)."""

    def __init__(self, parts: EngineParts, departures: Departures) -> None:
        self.parts, self.departures = parts, departures
        self.pipeline: Pipeline | None = None  # the last step's tokens, queued and not yet read

    def choose(self, sequences: list[RequestState], logits: mx.array, pending: mx.array | None = None) -> list[Picked]:
        """The sequences' choices in one graph (``choosing.choose``) over the rows of ``logits``
        (``(n, vocab)``, one row per sequence in order); one whose settings fail ends
        alone. ``pending``: their input tokens ``(n,)``, not recorded yet where in ``pipeline``."""
        rows, kept = [], []
        for i, sequence in enumerate(sequences):
            if sequence in self.parts.replays:  # replaying: its next token is known
                continue
            try:
                in_flight = pending is not None and sequence in (self.pipeline or ())
                rows.append(sequence.choice_row(int(in_flight), logits.shape[-1]))
                kept.append(i)
            except Exception as exc:
                self.departures.fail(sequence, exc)
        if not rows:
            return []
        if len(kept) < len(sequences):
            logits = logits[mx.array(kept)]
            pending = pending[mx.array(kept)] if pending is not None else None
        kept_sequences = [sequences[i] for i in kept]
        try:
            return [choice(kept_sequences, *choose(logits, rows, pending))]
        except Exception:  # one row's settings: choose row by row, and fail only the rows that fail
            choices = []
            for i, (sequence, row) in enumerate(zip(kept_sequences, rows)):
                try:
                    one = pending[i : i + 1] if pending is not None else None
                    choices.append(choice([sequence], *choose(logits[i : i + 1], [row], one)))
                except Exception as exc:
                    self.departures.fail(sequence, exc)
            return choices

    def hand_out(self, queued: list[Picked], now: list[Picked]) -> None:
        """Queue ``queued`` for the next step (``Pipeline``); read the tokens in flight and
        ``now`` in one sync, and hand them out."""
        last, self.pipeline = self.pipeline, Pipeline(queued) if queued else None
        picked = (last.picked if last is not None else []) + now
        if picked:
            self.emit(picked)

    def drain(self) -> bool:
        """Hand out the tokens in flight (before a preemption, or rows rerun alone): every row
        then holds its sequence's tokens but the last. Whether there were any."""
        if self.pipeline is None:
            return False
        self.hand_out([], [])
        return True

    def emit(self, picked: list[Picked]) -> None:
        """Evaluate the chosen tokens (and the logprobs asked for) in one sync, record them, send the events."""
        try:
            values = read(picked)  # the step's one host sync
        except Exception:  # find whose arrays fail
            picked = [p for p in picked if self._evaluates(p.sequences, arrays(p))]
            values = read(picked)
        emitted: list[tuple[RequestState, TokenEvent]] = []
        for sequence, token, logprob, top in (row for p, v in zip(picked, values) for row in each_row(p, v)):
            if sequence.status is Status.FINISHED:  # a stop ended it earlier in its speculation round
                continue
            try:
                event = sequence.event(sequence.record(token), token, logprob, top)  # finished when a stop hit
            except Exception as exc:  # e.g. a constraint refusing the token, or the detokenizer failing
                self.departures.fail(sequence, exc)
                continue
            emitted.append((sequence, event))
        handles = {}
        for sequence in dict.fromkeys(s for s, _ in emitted):  # each sequence once, in order
            handles[id(sequence)] = self.parts.handles.get(id(sequence))
            if sequence.speculator is not None and sequence.finish_reason != "error":
                try:  # its row must hold exactly its tokens before the prefix cache keeps them
                    sequence.settle()
                except Exception as exc:
                    self.departures.fail(sequence, exc)
                    continue
            if sequence.status is Status.FINISHED and sequence.finish_reason != "error":
                self.departures.retire(sequence)
        for sequence, event in emitted:
            handle = handles.get(id(sequence))
            if handle is not None:
                self.parts.metrics.event(handle, event)
                handle._put(event)

    def _evaluates(self, sequences: list[RequestState], values: list[mx.array]) -> bool:
        """Evaluate one choice's arrays; on failure its sequences fail."""
        try:
            mx.eval(values)
        except Exception as exc:
            for sequence in dict.fromkeys(sequences):
                self.departures.fail(sequence, exc)
            return False
        return True
