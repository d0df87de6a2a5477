"""The engine's decode step: the running sequences split into the decoding rows and the
speculation rounds (``_propose``), then one forward for the decoding rows, the prompt chunks
riding beside them and the rounds (``BatchRunner.step``: every row is written before any is
read, so the batch's buffers are written in place), and its fault path: the rows rerun alone,
so that the one at fault fails alone. A base of ``Engine``, which holds the state named below."""

from __future__ import annotations

import mlx.core as mx

from mlxformer.engine.batch_runner import BatchRunner, TokenRun, speculation_round
from mlxformer.engine.choices import Choice, Pipeline
from mlxformer.engine.memory import held
from mlxformer.engine.replay import Replays, rewind_caches
from mlxformer.engine.scheduler import Chunk
from mlxformer.engine.sequence import Sequence, Status


class DecodeStep:
    """The batched decode step with what rides in its forward (``Engine``'s state)."""

    runner: BatchRunner
    pipeline: Pipeline | None
    replays: Replays

    def _fail(self, sequence: Sequence, error: BaseException) -> None:
        raise NotImplementedError

    def _drain(self) -> bool:
        raise NotImplementedError

    def _preempt(self, sequence: Sequence, keep_cache: bool = True) -> None:
        raise NotImplementedError

    def _choose_each(self, sequences: list[Sequence], logits: list[mx.array], pending: mx.array | None = None) -> list[Choice]:
        raise NotImplementedError

    def _decode(self, decode: list[Sequence], riding: list[Chunk], ridden: dict[int, mx.array | None],
                rounds: list[tuple[Sequence, mx.array]], verified: dict[int, mx.array]) -> tuple[list[Choice], bool]:
        """One batched decode step, with the ``riding`` prompt chunks and the speculation
        ``rounds`` (each sequence's proposals) in its forward (their logits go to ``ridden`` and
        ``verified``); the choices of the sequences that are not replaying, and whether they
        were rerun alone. A sequence whose last step's token is still in flight is fed it from
        the device, and its penalties count it (``pending``).

        If the step fails, each sequence's row is rolled back and runs alone, so that the one at fault fails alone (one that cannot be rolled back is
        recomputed); the chunks and rounds are rolled back and run alone after it."""
        replaying = {id(s) for s in decode if s in self.replays}
        offsets, keys = [held(s) for s in decode], [s.key for s in decode]
        prompts = {id(c.sequence): (c.sequence, held(c.sequence)) for c in riding}  # before the step
        prompts.update({id(s): (s, held(s)) for s, _ in rounds})
        try:
            inputs = self.pipeline.inputs(decode) if self.pipeline is not None else None  # (B,) or None
            logits, chunk_logits = self.runner.step(decode, [
                TokenRun(c.tokens, c.sequence.cache, c.last, len(c.sequence.prompt), adapters=c.sequence.adapters)
                for c in riding] + [speculation_round(s.last_token, proposed, s.cache, s.adapters) for s, proposed in rounds], inputs)
            ridden.update({id(c): x for c, x in zip(riding, chunk_logits)})
            verified.update({id(s): x for (s, _), x in zip(rounds, chunk_logits[len(riding):])})  # type: ignore[misc]
            if logits is None:
                return [], False
            mx.async_eval(logits)  # constraints compute their masks while the step runs
            rows = [i for i, s in enumerate(decode) if id(s) not in replaying]
            choosing = [decode[i] for i in rows]
            chosen = logits[mx.array(rows)] if len(rows) < len(decode) else logits
            pending = None if inputs is None else inputs[mx.array(rows)] if len(rows) < len(decode) else inputs
            choices = self._choose_each(choosing, [chosen], pending) if choosing else []
        except Exception:
            for sequence, key in zip(decode, keys):
                sequence.key = key
            ridden.clear()
            verified.clear()
            for sequence, before in prompts.values():  # their chunks and rounds run alone from now on (after the rows)
                sequence.packs = False
                if not rewind_caches(sequence.cache, before):
                    self._preempt(sequence, keep_cache=False)
            return self._decode_alone(decode, offsets, replaying), True
        self.replays.advance(decode)
        return choices, False

    def _decode_alone(self, decode: list[Sequence], offsets: list[int], replaying: set[int]) -> list[Choice]:
        """Each row of a failed step rolled back in its row and run alone (one that cannot be
        rolled back is recomputed), so that the one at fault fails alone."""
        self._drain()  # the rows then take their last tokens from the host, and end alone if those end them
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
                self._preempt(sequence, keep_cache=False)
        choices: list[Choice] = []
        for sequence in alone:
            try:
                logits = self.runner.decode([sequence])
                mx.eval(logits)
            except Exception as exc:
                self._fail(sequence, exc)
                continue
            self.replays.advance([sequence])
            if id(sequence) not in replaying:
                choices += self._choose_each([sequence], [logits])
        return choices

    def _propose(self, running: list[Sequence]) -> tuple[list[Sequence], list[tuple[Sequence, mx.array]]]:
        """Split the running sequences into those decoding one token in the batch and those
        with proposals to verify (each with its proposals)."""
        decode, verifying = [], []
        for sequence in running:
            if sequence.speculator is None or sequence in self.replays:
                decode.append(sequence)
                continue
            try:
                proposed = sequence.propose()
            except Exception as exc:  # e.g. a draft model failing
                self._fail(sequence, exc)
                continue
            if proposed is not None:
                verifying.append((sequence, proposed))
            else:
                decode.append(sequence)
        return decode, verifying
