"""Which sequences run at each engine step: admission bounded by ``max_batch`` (and by what the
engine says fits), a bounded waiting queue, and each step's plan as a token budget (vLLM's and
Sarathi-Serve's chunked prefill): one decode token for every running sequence, then prompt
chunks of every prefilling sequence, newcomers then shortest remaining prompt first (a prompt
starved for ``MAX_PREFILL_WAIT`` steps before them all), within ``step_tokens``;
preempted sequences go back to the front of the queue."""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Container

from mlxformer.device import on_cpu
from mlxformer.engine.request_state import RequestState, Status
from mlxformer.errors import MlxformerError
from mlxformer.sampling.options import check_integer

# Tokens one engine step runs (decode rows and prompt chunks). A GPU step is memory bound up to
# a few thousand tokens, so a large budget costs the decoding rows little; on the CPU a step's
# time grows with its tokens (one forward of 4 chunks costs 4 forwards of one), so the budget
# only sets how long a request waits behind others' chunks: one chunk (a short request sent
# while a 3,000-token prompt prefills gets its first token after ~2 chunks: 0.1 of the long TTFT).
GPU_STEP_TOKENS = 2048
CPU_STEP_TOKENS = 128
# Aging: a prefilling prompt that got no chunk for this many steps goes first (oldest first), so
# no stream of newcomers or shorter prompts can starve it: the oldest prefilling prompt gets a
# chunk at least once every MAX_PREFILL_WAIT + 1 steps (docs/design/scheduler.md).
MAX_PREFILL_WAIT = 4


class EngineOverloaded(MlxformerError):
    """The engine's waiting queue is full: retry later."""


class EngineNotRunning(MlxformerError):
    """The engine is not running (not started, stopped, or its thread ended): it takes no requests."""


@dataclass
class Chunk:
    """The next piece of one newcomer's prompt."""

    sequence: RequestState
    tokens: list[int]
    last: bool  # the chunk ends the prompt: its logits give the first token


@dataclass
class Step:
    """The work of one engine step."""

    prefill: list[Chunk] = field(default_factory=list)  # a sequence's chunks in prompt order
    decode: list[RequestState] = field(default_factory=list)  # sequences decoding one token each

    def fed(self, draft_tokens: int) -> dict[int, int]:
        """id(sequence) -> the tokens its row takes in this step beyond a decode token: its
        prompt chunks' (a sequence may run several), or a speculation round's
        (``1 + draft_tokens``, or one token)."""
        fed: dict[int, int] = {}
        for chunk in self.prefill:
            fed[id(chunk.sequence)] = fed.get(id(chunk.sequence), 0) + len(chunk.tokens)
        for sequence in self.decode:
            if sequence.speculator is not None:
                fed[id(sequence)] = 1 + draft_tokens
        return fed


class Scheduler:
    """Queues, admits and plans: thread-safe ``add``; the rest runs on the engine thread."""

    def __init__(self, max_batch: int, max_queue: int, prefill_chunk: int, step_tokens: int | None = None,
                 aligned: bool = False) -> None:
        if step_tokens is None:  # the default device's
            step_tokens = CPU_STEP_TOKENS if on_cpu() else GPU_STEP_TOKENS
        for name, value, low in (("max_batch", max_batch, 1), ("max_queue", max_queue, 0),
                                 ("prefill_chunk", prefill_chunk, 1), ("step_tokens", step_tokens, 1)):
            check_integer(name, value, low=low)
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.step_tokens = step_tokens
        self.aligned = aligned  # chunks end at multiples of prefill_chunk (a hybrid model's snapshots)
        self.waiting: deque[RequestState] = deque()
        self.prefilling: list[RequestState] = []
        self.running: list[RequestState] = []
        self.lock = threading.Lock()
        self._arrival: dict[int, int] = {}  # id(sequence) -> submission order
        self._counter = itertools.count()
        self.steps = 0  # steps planned so far
        self._chunked: dict[int, int] = {}  # id(prefilling sequence) -> the step it last got a chunk (or was admitted)

    def add(self, sequence: RequestState) -> None:
        """Queue a new sequence; raises ``EngineOverloaded`` when the queue is full (the requests
        that will take a free slot at the next step do not count)."""
        with self.lock:
            free = max(0, self.max_batch - len(self.active))
            if len(self.waiting) - free >= self.max_queue:
                raise EngineOverloaded(f"the engine's queue is full ({self.max_queue} waiting requests)")
            self.waiting.append(sequence)
            self._arrival[id(sequence)] = next(self._counter)

    @property
    def active(self) -> list[RequestState]:
        """The sequences holding a batch slot (prefilling, then running)."""
        return self.prefilling + self.running

    def has_work(self) -> bool:
        with self.lock:
            return bool(self.waiting or self.prefilling or self.running)

    def admit(self, fits: Callable[[RequestState], bool] = lambda s: True) -> list[RequestState]:
        """Move waiting sequences into free batch slots, in order while ``fits`` says the next one
        does; returns them (to be given caches)."""
        admitted = []
        with self.lock:
            while self.waiting and len(self.active) < self.max_batch:
                if self.waiting[0].cancelled or not fits(self.waiting[0]):
                    break  # a cancelled one is dropped (and told) at the next step
                sequence = self.waiting.popleft()
                sequence.status = Status.PREFILLING
                self.prefilling.append(sequence)
                self._chunked[id(sequence)] = self.steps
                admitted.append(sequence)
        return admitted

    def drop_cancelled_waiting(self) -> list[RequestState]:
        """Remove cancelled sequences that never got a slot; returns them (each to be ``release``d)."""
        with self.lock:
            dropped = [s for s in self.waiting if s.cancelled]
            self.waiting = deque(s for s in self.waiting if not s.cancelled)
        return dropped

    def plan(self, skip: Container[RequestState] = ()) -> Step:
        """This step's work within ``step_tokens``: every running sequence decodes one token,
        then the prefilling sequences get prompt chunks in rounds (one chunk each per round;
        those with nothing prefilled yet first, then the shortest remaining prompt) while the
        budget lasts; at least one chunk always runs. A newcomer's first chunk thus runs at its
        first step, unless a prompt starved for ``MAX_PREFILL_WAIT`` steps takes the budget first.

        A prompt is cut as ``prefill`` cuts it alone (chunks of ``prefill_chunk``, then the
        rest), so that its computation, and hence its output, is the same as when it runs alone.
        Sequences in ``skip`` (waiting for a shared prefix) get no chunk. ``aligned``: every
        chunk ends at a multiple of ``prefill_chunk`` (or the prompt's end), wherever the prompt
        resumed, so a hybrid model's state snapshots (taken at chunk ends) fall on the same
        positions, and a prompt resumed from one is cut as it is cut cold; and a sequence gets
        one chunk per step (its snapshot is taken after the step)."""
        step = Step(decode=list(self.running))
        budget = self.step_tokens - len(step.decode)
        self.steps += 1
        queue = sorted((s for s in self.prefilling if s not in skip), key=self._priority)
        planned = {id(s): s.processed for s in queue}  # each one's prompt position after its planned chunks
        while queue:
            for sequence in list(queue):
                start = planned[id(sequence)]
                size = min(self.prefill_chunk - (start % self.prefill_chunk if self.aligned else 0),
                           len(sequence.prompt) - start)
                if step.prefill and size > budget:
                    queue = []  # the budget is spent: this round ends the plan
                    break
                step.prefill.append(Chunk(sequence, sequence.prompt[start : start + size], start + size == len(sequence.prompt)))
                self._chunked[id(sequence)] = self.steps
                planned[id(sequence)], budget = start + size, budget - size
                if start + size == len(sequence.prompt):
                    queue.remove(sequence)
            if self.aligned:
                break
        return step

    def _priority(self, sequence: RequestState) -> tuple:
        """Chunk order: prompts starved for ``MAX_PREFILL_WAIT`` steps (oldest first), then
        newcomers, then the shortest remaining prompt."""
        starved = self.steps - self._chunked.get(id(sequence), self.steps) > MAX_PREFILL_WAIT
        return (not starved, self._arrival.get(id(sequence), 0) if starved else 0,
                sequence.processed > sequence.cached_tokens, len(sequence.prompt) - sequence.processed)

    def start_decoding(self, sequence: RequestState) -> None:
        """A newcomer's prompt is done: it decodes from the next step on."""
        self.prefilling.remove(sequence)
        sequence.status = Status.RUNNING
        self.running.append(sequence)

    def release(self, sequence: RequestState) -> None:
        """Free the sequence's slot (finished or cancelled)."""
        with self.lock:
            self._unslot(sequence)
            self._arrival.pop(id(sequence), None)
            self._chunked.pop(id(sequence), None)

    def _unslot(self, sequence: RequestState) -> None:
        """Take ``sequence`` out of the queue or its batch slot, wherever it is."""
        for active in (self.waiting, self.prefilling, self.running):
            if sequence in active:
                active.remove(sequence)

    def latest_active(self) -> RequestState | None:
        """The active sequence submitted last (the first to preempt)."""
        active = self.active
        return max(active, key=lambda s: self._arrival[id(s)]) if active else None

    def preempt(self, sequence: RequestState) -> None:
        """Take an active sequence out of the batch, back to the queue in submission order
        (ahead of every newer request: it is readmitted first)."""
        with self.lock:
            self._unslot(sequence)
            sequence.status = Status.WAITING
            order = self._arrival[id(sequence)]
            at = next((i for i, s in enumerate(self.waiting) if self._arrival.get(id(s), order) > order), len(self.waiting))
            self.waiting.insert(at, sequence)

    def clear(self) -> list[RequestState]:
        """Remove every sequence (waiting or active); returns them."""
        with self.lock:
            everything = [*self.waiting, *self.prefilling, *self.running]
            for held in (self.waiting, self.prefilling, self.running, self._arrival, self._chunked):
                held.clear()
        return everything
