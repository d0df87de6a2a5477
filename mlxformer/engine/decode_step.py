"""The engine's decode step (``DecodeStep``): the running sequences split into the decoding rows
and the speculation rounds (``propose``), then one forward for the decoding rows, the prompt
chunks riding beside them and the rounds (``BatchRunner.step``: every row is written before any
is read, so the pools' buffers are written in place), and its fault path: each row rolled back
in place and rerun alone, so that the one at fault fails alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import mlx.core as mx

from mlxformer.engine.batch_runner import TokenRun, speculation_round
from mlxformer.engine.choices import Picked
from mlxformer.engine.delivery import Delivery
from mlxformer.engine.departures import Departures
from mlxformer.engine.parts import EngineParts
from mlxformer.engine.replay import rewind_caches
from mlxformer.engine.request_state import RequestState, Status
from mlxformer.engine.scheduler import Chunk


class Round(NamedTuple):
    """A speculating sequence's proposals to verify this step."""

    sequence: RequestState
    proposed: mx.array  # (k,) maybe still on the device


@dataclass
class Decoded:
    """What the decode step's forward gave."""

    choices: list[Picked] = field(default_factory=list)  # the decoding rows' (not those replaying)
    alone: bool = False  # the rows were rerun one by one (their choices are read now)
    chunk_logits: dict[int, mx.array | None] = field(default_factory=dict)  # id(riding chunk) -> its logits
    round_logits: dict[int, mx.array] = field(default_factory=dict)  # id(sequence) -> its round's logits


class DecodeStep:
    """The batched decode step with what rides in its forward."""

    def __init__(self, parts: EngineParts, departures: Departures, delivery: Delivery) -> None:
        self.parts, self.departures, self.delivery = parts, departures, delivery

    def propose(self, running: list[RequestState]) -> tuple[list[RequestState], list[Round]]:
        """Split the running sequences into those decoding one token in the batch and those
        with proposals to verify."""
        decode, rounds = [], []
        for sequence in running:
            if sequence.speculator is None or sequence in self.parts.replays:
                decode.append(sequence)
                continue
            try:
                proposed = sequence.propose()
            except Exception as exc:  # e.g. a draft model failing
                self.departures.fail(sequence, exc)
                continue
            if proposed is not None:
                rounds.append(Round(sequence, proposed))
            else:
                decode.append(sequence)
        return decode, rounds

    def run(self, decode: list[RequestState], riding: list[Chunk], rounds: list[Round]) -> Decoded:
        """One batched decode step with the ``riding`` prompt chunks and the speculation
        ``rounds`` in its forward. A sequence whose last step's token is still in flight is fed
        it from the device, and its penalties count it (``pending``).

        If the step fails, each sequence's row is rolled back and runs alone, so that the one at
        fault fails alone (one that cannot be rolled back is recomputed); the chunks and rounds
        are rolled back and run alone after it (their logits are then not in the result)."""
        replays, pipeline = self.parts.replays, self.delivery.pipeline
        offsets, keys = [s.cache_offset for s in decode], [s.key for s in decode]
        prompting = [c.sequence for c in riding] + [r.sequence for r in rounds]
        prompts = {id(s): (s, s.cache_offset) for s in prompting}  # before the step
        result = Decoded()
        try:
            inputs = pipeline.inputs(decode) if pipeline is not None else None  # (B,) or None
            runs = [TokenRun(c.tokens, c.sequence.cache, c.last, len(c.sequence.prompt), adapters=c.sequence.adapters)
                    for c in riding]
            runs += [speculation_round(r.sequence.last_token, r.proposed, r.sequence.cache, r.sequence.adapters)
                     for r in rounds]
            logits, run_logits = self.parts.runner.step(decode, runs, inputs)
            result.chunk_logits = {id(c): x for c, x in zip(riding, run_logits)}
            result.round_logits = {id(r.sequence): x for r, x in zip(rounds, run_logits[len(riding):])}  # type: ignore[misc]
            if logits is None:
                return result
            mx.async_eval(logits)  # constraints compute their masks while the step runs
            result.choices = self.delivery.choose(decode, logits, inputs)  # (not the replaying rows')
        except Exception:
            for sequence, key in zip(decode, keys):
                sequence.key = key
            for sequence, before in prompts.values():  # their chunks and rounds run alone from now on (after the rows)
                sequence.packs = False
                if not rewind_caches(sequence.cache, before):
                    self.departures.preempt(sequence, keep_cache=False)
            return Decoded(self.run_alone(decode, offsets), alone=True)
        replays.advance(decode)
        return result

    def run_alone(self, decode: list[RequestState], offsets: list[int]) -> list[Picked]:
        """Each row of a failed step rolled back in its row to ``offsets`` and run alone (one
        that cannot be rolled back is recomputed), so that the one at fault fails alone."""
        self.delivery.drain()  # the rows then take their last tokens from the host, and end alone if those end them
        alone = []
        for sequence, before in zip(decode, offsets):
            if sequence.status is Status.FINISHED:  # e.g. its constraint failed while the step was built
                continue
            try:
                rolled_back = rewind_caches(sequence.cache, before)
            except Exception:
                rolled_back = False
            if rolled_back:
                alone.append(sequence)
            else:  # recompute it
                self.departures.preempt(sequence, keep_cache=False)
        choices: list[Picked] = []
        for sequence in alone:
            try:
                logits = self.parts.runner.decode([sequence])
                mx.eval(logits)
            except Exception as exc:
                self.departures.fail(sequence, exc)
                continue
            choices += self.delivery.choose([sequence], logits)  # before its replay advances
            self.parts.replays.advance([sequence])
        return choices
