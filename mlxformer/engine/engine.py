"""The engine: a background thread that loops schedule -> run -> postprocess over the requests
submitted through ``RequestHandle``s (``handle.py``).

Error boundaries: whatever fails in one sequence's prefill, decode step, speculation,
constraint or detokenization ends that request alone (its handle raises the error); a batched
decode step that fails is rolled back and rerun sequence by sequence to find which one.
With a KV budget (``max_kv_memory``, ``memory.py``) each step is planned to fit it: prefix
entries are evicted, then the most recently admitted sequences are preempted (their caches go
to the prefix cache; the rest is recomputed when they are admitted again: the prompt as a
prefill, the generated tokens replayed through decode steps, so the output does not change)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

import mlx.core as mx
from prometheus_client import CollectorRegistry

from mlxformer.adapters.layers import cache_salt, select
from mlxformer.cache import CacheSettings
from mlxformer.engine.admission import Admission, warm_up
from mlxformer.engine.batch_runner import BatchRunner
from mlxformer.engine.decode_step import DecodeStep
from mlxformer.engine.handle import RequestHandle
from mlxformer.engine.jobs import Jobs
from mlxformer.engine.memory import KVBudgetExceeded, KVSizer, MemoryPlanner, nbytes, resolve_budget
from mlxformer.engine.metrics import EngineMetrics
from mlxformer.engine.prefix_sharing import PrefixSharing
from mlxformer.engine.prompt_cache import PromptCacheSettings, build_prefix_cache
from mlxformer.engine.replay import Replays
from mlxformer.engine.scheduler import EngineNotRunning, Scheduler, Step
from mlxformer.engine.sequence import GenerationRequest, Sequence, Status, TokenEvent, check_request
from mlxformer.sampling.choosing import choose
from mlxformer.engine.choices import Choice, Picked, Pipeline, arrays, each_row, read, with_logprobs
from mlxformer.generation.decoding import with_rewind
from mlxformer.sampling.options import SamplingSettings
from mlxformer.speculative.speculator import SpeculativeSettings, check_draft
from mlxformer.generation.steps import default_prefill_step
from mlxformer.models.decoder import Model
from mlxformer.text.tokenizer import Tokenizer

log = logging.getLogger("mlxformer.engine")
T = TypeVar("T")


class Engine(Admission, DecodeStep):
    """Continuous-batching generation over one model: see the module docstring of ``mlxformer.engine``.

    ``speculative``: decode every request (unless it sets ``speculate=False`` or has a constraint)
    speculatively; each one's proposals are verified in its own pass over its caches (its row of
    the decode batch when seated; its ``DecodingState`` decides the round and ``settle``s them).
    ``max_kv_memory``: the bytes of KV cache (sequences and prefix cache together) the engine may
    hold, or ``"auto"`` (the device's memory less the weights and a margin); while it runs, MLX's
    memory and cache limits are set from the same figure. ``metrics``: the Prometheus registry
    to register the engine's metrics in (default: a new one, ``engine.metrics.registry``).
    ``prefill_chunk``: prompt tokens per chunk (cut as ``prefill`` cuts a prompt alone);
    ``step_tokens``: tokens per step, decode rows and prompt chunks together (``scheduler.py``)."""

    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer,
        *,
        max_batch: int = 8,
        max_queue: int = 64,
        cache_settings: CacheSettings | None = None,
        prefix_cache_bytes: int = 512 * 2**20,
        prefill_chunk: int | None = None,
        step_tokens: int | None = None,
        speculative: SpeculativeSettings | None = None,
        prompt_cache: PromptCacheSettings | None = None,
        max_kv_memory: int | str | None = None,
        metrics: CollectorRegistry | None = None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.speculative = speculative
        if speculative is not None:
            check_draft(speculative, tokenizer)
        self.cache_settings = with_rewind(cache_settings, speculative) or CacheSettings()
        kv_dtype = warm_up(model, speculative.draft_model if speculative is not None else None, self.cache_settings)
        self.draft_tokens = speculative.num_draft_tokens if speculative is not None else 0
        self.budget = resolve_budget(model, max_kv_memory)
        self.scheduler = Scheduler(max_batch, max_queue, prefill_chunk or default_prefill_step(), step_tokens,
                                   aligned=any(layer.recurrent or layer.window for layer in model.layers))
        self.runner = BatchRunner(model)
        self.runner.staged = self.budget is not None  # a request's peak is then its own size (memory.py)
        self.runner.max_rows = max_batch  # a decode batch's spare rows (cache/rows.py)
        self.runner.prefill_chunk = self.scheduler.prefill_chunk  # a rotating row's slots past its window
        self.sizer = KVSizer(model, self.cache_settings, self.draft_tokens, self.runner.row_key)
        self.planner = MemoryPlanner(self.sizer, self.budget, self.draft_tokens)
        # ``prompt_cache``: the tiers (memory budget, disk directory); else memory of ``prefix_cache_bytes``
        tiers = prompt_cache or PromptCacheSettings(memory_bytes=prefix_cache_bytes)
        self.prefix_cache = build_prefix_cache(model, tokenizer, self.cache_settings, tiers, kv_dtype)
        self.sharing = PrefixSharing(self.prefix_cache, tiers.share_prefills)
        self._reserve(max_batch, kv_dtype)
        self.sharing.caches = self.runner.caches  # a prefilling sequence's keys/values are in its row
        self.vocab_size = model.args.vocab_size
        self.metrics = EngineMetrics(metrics)
        self.metrics.watch(lambda: len(self.scheduler.waiting), lambda: self.scheduler.active, lambda: self.held_kv,
                           self.budget.limit if self.budget is not None else 0)
        self.metrics.step_reserve.set(self.budget.reserve if self.budget is not None else 0)
        self._handles: dict[int, RequestHandle] = {}
        self.held_kv = 0  # KV bytes held after the last step (``kv_bytes``), for the metrics thread
        self.jobs = Jobs()  # embedding/rerank forwards, run between steps (``run_job``)
        self.replays = Replays()  # preempted sequences catching up
        self.pipeline: Pipeline | None = None  # the last step's tokens, queued and not yet read
        self.overlap = True  # queue step n+1 before reading step n's tokens (off: to measure it)
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._died = False  # the loop ended on its own (set before its requests are failed)
        self._limits: tuple[int, int] | None = None  # MLX's limits before start(), restored by stop()

    # --- public API ---------------------------------------------------------------------

    def start(self) -> "Engine":
        """Start the background loop (idempotent)."""
        with self._wake:
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                self._died = False
                if self.budget is not None and self._limits is None:
                    self._limits = self.budget.apply()
                self._thread = threading.Thread(target=self._loop, name="mlxformer-engine", daemon=True)
                self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the loop and join it; requests in flight or waiting end as cancelled."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._wake:
            self._thread = None
            for sequence in self.scheduler.clear():
                self._end(sequence, "cancelled")
            for handle in list(self._handles.values()):  # e.g. the loop ended before they were admitted
                self._end(handle.sequence, "cancelled")
            self.replays.clear()
            self.jobs.fail_all(EngineNotRunning("the engine stopped"))
            self.pipeline = None
            self.runner.reset()  # its buffers were built on the ended thread's streams
            self.prefix_cache.flush()  # the disk tier's writes are done when stop returns
            if self._limits is not None:
                self.budget.restore(self._limits)  # type: ignore[union-attr]
                self._limits = None

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        """Whether the loop is running and takes requests."""
        return (self._thread is not None and self._thread.is_alive()
                and not self._stopping and not self._died)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue ``request``; raises ``MlxformerError`` on an invalid request, ``KVBudgetExceeded``
        when its KV cache can never fit the budget, ``EngineOverloaded`` when the queue is full and
        ``EngineNotRunning`` unless the engine is running."""
        check_request(request, self.vocab_size)
        request = self.planner.fitted(request)
        self.planner.check(request)
        sequence = Sequence(request, self.tokenizer.detokenizer(), self.tokenizer.eos_token_ids)
        self.model.args.check_positions(len(request.prompt_ids) + request.max_tokens)  # (max_tokens checked)
        sequence.cache_salt = cache_salt(self.model, request.adapters)
        handle = RequestHandle(sequence, self._notify)
        with self._wake:
            if not self.running:
                raise EngineNotRunning("the engine is not running (call start() first; it is stopped, or its thread ended)")
            self._handles[id(sequence)] = handle  # before the loop can see the sequence: no event is missed
            try:
                self.scheduler.add(sequence)
            except Exception:
                del self._handles[id(sequence)]
                raise
            self._wake.notify_all()
        return handle

    def run_job(self, work: Callable[[], T]) -> "Future[T]":
        """Run ``work`` (a forward that keeps no cache: embeddings, rerank scores) on the engine's
        thread between two steps; raises ``EngineNotRunning`` unless the engine is running."""
        with self._wake:
            if not self.running:
                raise EngineNotRunning("the engine is not running (call start() first; it is stopped, or its thread ended)")
            future = self.jobs.add(work)
            self._wake.notify_all()
        return future

    @property
    def active(self) -> int:
        """Requests holding a batch slot."""
        return self.scheduler.active

    def kv_bytes(self) -> int:
        """KV bytes held now: every active sequence's caches (its share of a batch's) and the prefix cache."""
        with self.scheduler.lock:
            active = self.scheduler.prefilling + self.scheduler.running
        return sum(nbytes(s) for s in active) + self.prefix_cache.nbytes

    # --- the loop -------------------------------------------------------------------------

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def _loop(self) -> None:
        try:
            self._serve()
        finally:  # an MLX thread must release its streams before it ends, or exit may abort
            mx.clear_streams()
            if not self._stopping:  # the loop died: nothing will serve the requests it had
                with self._wake:
                    self._died = True  # before the requests hear of it: /health must already say so
                    self._fail_all(EngineNotRunning("the engine's thread ended"))

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self.scheduler.has_work() and not self.jobs:
                    self._wake.wait()
                if self._stopping:
                    return
            self.jobs.run_all()
            if not self.scheduler.has_work():
                continue
            try:
                self.step()
            except Exception as exc:  # a fault outside any one sequence: fail those in flight, keep serving
                self._fail_all(exc)

    def _fail_all(self, error: BaseException) -> None:
        """Fail every request and job in flight with ``error`` (under the lock ``submit`` takes: a
        request submitted meanwhile is either failed here or served by the next step)."""
        with self._wake:
            self.jobs.fail_all(error)
            self.pipeline = None
            self.runner.reset()
            self.sharing.held.clear()
            self.scheduler.clear()
            self.replays.clear()
            for handle in list(self._handles.values()):
                handle.sequence.finish("error")
                self._handles.pop(id(handle.sequence), None)
                handle._put(error=error)

    def step(self) -> None:
        """One engine step: drop cancelled, admit, fit the step into the KV budget, run a prompt
        chunk and a decode step, emit."""
        layout = self._kv_layout()
        for sequence in self.scheduler.drop_cancelled_waiting():
            self._end(sequence, "cancelled")
        for sequence in self.scheduler.prefilling + self.scheduler.running:
            if sequence.cancelled:
                self._end(sequence, "cancelled")
        for sequence in self.scheduler.admit(lambda s: self.planner.admissible(self.scheduler, s)):
            self.sharing.hold(sequence)  # until the blocks it shares with a running prefill are cached
        for sequence in self.sharing.ready(self.scheduler.prefilling):
            try:
                self._attach_cache(sequence)
            except Exception as exc:  # e.g. a draft model's cache
                self._fail(sequence, exc)
        step = self._grow(self._fit(self.scheduler.plan(skip=self.sharing.held)))
        self._run(step)
        self._drop_freed(layout, prompted=bool(step.prefill))
        self.held_kv = self.kv_bytes()  # what the metrics read (never the caches the engine swaps)

    # --- running a step -------------------------------------------------------------------

    def _run(self, step: Step) -> None:
        """Build the step (its decode rows fed the last step's tokens where they are pending),
        then hand out: overlapped, the decode rows' choices are queued and the last step's read
        (``_hand_out``); a step whose choices must be read now (a first token, a speculation
        round, a constraint's next mask, a row rerun alone) reads the last step's and its own."""
        choices: list[Choice] = []  # to read in this step
        batched: list[Choice] = []  # the batched decode rows': queued for the next step's read when they can wait
        decode, verifying = self._propose(step.decode)
        # chunks in the decode step's forward (a scored prompt needs every position's logits: its own)
        riding = [c for c in step.prefill if c.sequence.prompt_scores is None and c.sequence.packs]
        ridden: dict[int, mx.array | None] = {}  # id(chunk) -> its logits, once its forward ran
        # speculation rounds too: their rows written before the batch's rows read the buffers
        rounds = [(s, proposed) for s, proposed in verifying if s.packs]
        verified: dict[int, mx.array] = {}  # id(sequence) -> its round's logits, once its forward ran
        if decode or riding or rounds:
            decoded, alone = self._decode(decode, riding, ridden, rounds, verified)
            (choices if alone else batched).extend(decoded)
        for sequence, proposed in verifying:
            if sequence.status is not Status.RUNNING:  # preempted after its round failed in the step
                continue
            try:
                logits = verified.get(id(sequence))
                if logits is None:
                    logits = self.runner.verify(sequence.last_token, proposed, sequence.cache, sequence.adapters)
                tokens, logprobs = sequence.verify(logits)
                choices.append(([sequence] * len(tokens), mx.array(tokens), logprobs))
            except Exception as exc:
                self._fail(sequence, exc)
        for chunk in step.prefill:
            sequence = chunk.sequence
            if sequence.status is not Status.PREFILLING:  # failed (or preempted) at an earlier chunk
                continue
            try:
                with select(self.model, [(sequence, 1)]):
                    logits = ridden[id(chunk)] if id(chunk) in ridden else self.runner.prefill(
                        chunk.tokens, sequence.cache, chunk.last, len(sequence.prompt), sequence.prompt_scores, sequence.processed)
                sequence.processed += len(chunk.tokens)
                self.metrics.prefilled_tokens.inc(len(chunk.tokens))
                self.sharing.publish(sequence)  # its blocks for those waiting on the same prefix
            except Exception as exc:
                self._fail(sequence, exc)
                continue
            if logits is None:
                continue
            self.scheduler.start_decoding(sequence)
            if sequence.generated:  # resumed after preemption: its next token is known
                self.replays.start(sequence, 0)
                continue
            mx.async_eval(logits)
            choices += self._choose_each([sequence], [logits])
        waits = self.overlap and not choices and all(s.constraint is None and s.speculator is None
                                                      for c in batched for s in c[0])
        if waits:
            self._hand_out(batched, [])
        else:
            self._hand_out([], batched + choices)

    def _hand_out(self, queued: list[Choice], now: list[Choice]) -> None:
        """Queue ``queued`` for the next step (``Pipeline``); read the tokens in flight and ``now`` in one sync, hand them out."""
        last, self.pipeline = self.pipeline, None
        if queued:
            self.pipeline = Pipeline([with_logprobs(choice) for choice in queued])
        picked = (last.picked if last is not None else []) + [with_logprobs(choice) for choice in now]
        if picked:
            self._emit(picked)

    def _drain(self) -> bool:
        """Hand out the tokens in flight (before a preemption, or rows rerun alone): every cache
        then holds its sequence's tokens but the last. Whether there were any."""
        return self.pipeline is not None and (self._hand_out([], []) or True)

    def _choose_each(self, sequences: list[Sequence], logits: list[mx.array], pending: mx.array | None = None) -> list[Choice]:
        """The sequences' choices in one graph (``choosing.choose``) over the rows of ``logits``
        (blocks ``(n, vocab)``, one row per sequence in order); one whose constraint fails ends
        alone. ``pending``: their input tokens ``(n,)``, not recorded yet where in ``self.pipeline``."""
        rows, kept = [], []
        batch_vocab = logits[0].shape[-1]
        for i, sequence in enumerate(sequences):
            try:
                rows.append(sequence.row(int(pending is not None and sequence in (self.pipeline or ())), batch_vocab))
                kept.append(i)
            except Exception as exc:
                self._fail(sequence, exc)
        if not rows:
            return []
        batch = logits[0] if len(logits) == 1 else mx.concatenate(logits)  # (B, vocab)
        if len(kept) < len(sequences):
            batch = batch[mx.array(kept)]
            pending = pending[mx.array(kept)] if pending is not None else None
        kept_sequences = [sequences[i] for i in kept]
        try:
            return [(kept_sequences, *choose(batch, rows, pending))]
        except Exception:  # one row's settings: choose row by row, and fail only the rows that fail
            choices = []
            for i, (sequence, row) in enumerate(zip(kept_sequences, rows)):
                try:
                    one = pending[i : i + 1] if pending is not None else None
                    choices.append(([sequence], *choose(batch[i : i + 1], [row], one)))
                except Exception as exc:
                    self._fail(sequence, exc)
            return choices

    # --- output -------------------------------------------------------------------------

    def _emit(self, picked: list[Picked]) -> None:
        """Evaluate the chosen tokens (and the logprobs asked for) in one sync, record them, send the events."""
        try:
            values = read(picked)  # the step's one host sync
        except Exception:  # find whose arrays fail
            picked = [p for p in picked if self._evaluates(p[0], arrays(p))]
            values = read(picked)
        emitted: list[tuple[Sequence, TokenEvent]] = []
        for sequence, token, logprob, top in (row for p, v in zip(picked, values) for row in each_row(p, v)):
            if sequence.status is Status.FINISHED:  # a stop ended it earlier in its speculation round
                continue
            try:
                event = sequence.accept(token, logprob, top)
            except Exception as exc:  # e.g. a constraint refusing the token, or the detokenizer failing
                self._fail(sequence, exc)
                continue
            emitted.append((sequence, event))
        handles = {}
        for sequence in dict.fromkeys(s for s, _ in emitted):  # each sequence once, in order
            handles[id(sequence)] = self._handles.get(id(sequence))
            if sequence.speculator is not None and sequence.finish_reason != "error":
                try:  # its caches must hold exactly its tokens before the prefix cache keeps them
                    sequence.settle()
                except Exception as exc:
                    self._fail(sequence, exc)
                    continue
            if sequence.status is Status.FINISHED and sequence.finish_reason != "error":
                self._retire(sequence)
        for sequence, event in emitted:
            handle = handles.get(id(sequence))
            if handle is not None:
                self.metrics.event(handle, event)
                handle._put(event)

    def _evaluates(self, sequences: list[Sequence], arrays: list[mx.array]) -> bool:
        """Evaluate one choice's arrays; on failure its sequences fail."""
        try:
            mx.eval(arrays)
        except Exception as exc:
            for sequence in dict.fromkeys(sequences):
                self._fail(sequence, exc)
            return False
        return True

    def _fail(self, sequence: Sequence, error: BaseException) -> None:
        """End one sequence with ``error`` (raised by its handle's iterator)."""
        sequence.finish("error")
        self._unbatch(sequence)
        self.scheduler.release(sequence)
        self.metrics.finished.labels("error").inc()
        handle = self._handles.pop(id(sequence), None)
        if handle is not None:
            handle._put(error=error)

    def _retire(self, sequence: Sequence) -> None:
        """Free a finished sequence's slot and offer its cache for prefix reuse (its blocks cut
        from where its keys/values are, its batch row too: one copy)."""
        self.replays.stop(sequence)
        kept = bool(sequence.cache)
        if kept:
            try:  # the reply is whole: a cache that cannot be kept is only not reused
                self._keep(sequence)
            except Exception:
                log.exception("a finished request's cache could not be kept for prefix reuse")
        self._unbatch(sequence)
        self.scheduler.release(sequence)
        self._handles.pop(id(sequence), None)
        if kept and self.budget is not None:  # within what the active sequences leave
            self.prefix_cache.evict_to(self.budget.limit - self.kv_bytes() + self.prefix_cache.nbytes)

    def _end(self, sequence: Sequence, reason: str) -> None:
        """End ``sequence`` early (cancelled) and tell its handle."""
        handle = self._handles.get(id(sequence))
        sequence.finish(reason)
        self._retire(sequence)
        if handle is not None:
            event = sequence.event("", None)
            self.metrics.event(handle, event)
            handle._put(event)
