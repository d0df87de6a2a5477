"""Which sequences run at each engine step: admission bounded by ``max_batch``, a bounded
waiting queue, one prompt chunk per step for newcomers, one decode step for the running."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Container

from mlxformer.engine.sequence import Sequence, Status
from mlxformer.errors import MlxformerError


class EngineOverloaded(MlxformerError):
    """The engine's waiting queue is full: retry later."""


@dataclass
class Chunk:
    """The next piece of one newcomer's prompt."""

    sequence: Sequence
    tokens: list[int]
    last: bool  # the chunk ends the prompt: its logits give the first token


@dataclass
class Step:
    """The work of one engine step."""

    prefill: list[Chunk] = field(default_factory=list)  # at most ``prefill_chunk`` tokens in all
    decode: list[Sequence] = field(default_factory=list)  # sequences decoding one token each


class Scheduler:
    """Queues, admits and plans: thread-safe ``add``; the rest runs on the engine thread."""

    def __init__(self, max_batch: int, max_queue: int, prefill_chunk: int) -> None:
        if max_batch < 1 or max_queue < 0 or prefill_chunk < 1:
            raise MlxformerError("need max_batch >= 1, max_queue >= 0 and prefill_chunk >= 1")
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []
        self.lock = threading.Lock()

    def add(self, sequence: Sequence) -> None:
        """Queue a new sequence; raises ``EngineOverloaded`` when the queue is full (the requests
        that will take a free slot at the next step do not count)."""
        with self.lock:
            free = max(0, self.max_batch - self.active)
            if len(self.waiting) - free >= self.max_queue:
                raise EngineOverloaded(f"the engine's queue is full ({self.max_queue} waiting requests)")
            self.waiting.append(sequence)

    @property
    def active(self) -> int:
        """Sequences holding a batch slot."""
        return len(self.prefilling) + len(self.running)

    def has_work(self) -> bool:
        with self.lock:
            return bool(self.waiting or self.prefilling or self.running)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free batch slots; returns them (to be given caches)."""
        admitted = []
        with self.lock:
            while self.waiting and self.active < self.max_batch:
                sequence = self.waiting.popleft()
                if sequence.cancelled:
                    continue
                sequence.status = Status.PREFILLING
                self.prefilling.append(sequence)
                admitted.append(sequence)
        return admitted

    def drop_cancelled_waiting(self) -> list[Sequence]:
        """Remove cancelled sequences that never got a slot; returns them."""
        with self.lock:
            dropped = [s for s in self.waiting if s.cancelled]
            self.waiting = deque(s for s in self.waiting if not s.cancelled)
        return dropped

    def plan(self, skip: Container[Sequence] = ()) -> Step:
        """This step's work: every running sequence decodes one token, and newcomers' next
        prompt chunks run, oldest first, within ``prefill_chunk`` tokens (the oldest always).

        A prompt is cut as ``prefill`` cuts it alone (full chunks, then the rest), so that its
        computation, and hence its output, is the same as when it runs alone. Sequences in
        ``skip`` (waiting for a shared prefix) get no chunk."""
        step = Step(decode=list(self.running))
        budget = self.prefill_chunk
        for sequence in self.prefilling:
            if sequence in skip:
                continue
            remaining = len(sequence.prompt) - sequence.processed
            size = self.prefill_chunk if remaining > self.prefill_chunk else remaining
            if step.prefill and size > budget:
                break
            tokens = sequence.prompt[sequence.processed : sequence.processed + size]
            step.prefill.append(Chunk(sequence, tokens, size == remaining))
            budget -= size
        return step

    def start_decoding(self, sequence: Sequence) -> None:
        """A newcomer's prompt is done: it decodes from the next step on."""
        self.prefilling.remove(sequence)
        sequence.status = Status.RUNNING
        self.running.append(sequence)

    def release(self, sequence: Sequence) -> None:
        """Free the sequence's slot (finished or cancelled)."""
        if sequence in self.prefilling:
            self.prefilling.remove(sequence)
        if sequence in self.running:
            self.running.remove(sequence)
