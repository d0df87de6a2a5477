"""The engine: a background thread that loops schedule -> run -> hand out over the requests
submitted through ``RequestHandle``s (``handle.py``), with named collaborators sharing
``EngineParts`` (``parts.py``): ``Admission`` seats admitted sequences and fits each step into
the KV budget (``admission.py``), ``DecodeStep`` runs the batched forward (``decode_step.py``),
``Delivery`` chooses and hands out the tokens (``delivery.py``) and ``Departures`` ends,
retires and preempts sequences (``departures.py``).

Error boundaries: whatever fails in one sequence's prefill, decode step, speculation,
constraint or detokenization ends that request alone (its handle raises the error); a batched
decode step that fails is rolled back and rerun sequence by sequence to find which one.
With a KV budget (``max_kv_memory``, ``memory.py``) each step is planned to fit it: prefix
entries are evicted, then the most recently admitted sequences are preempted (their caches go
to the prefix cache; the rest is recomputed when they are admitted again: the prompt as a
prefill, the generated tokens replayed through decode steps, so the output does not change)."""

from __future__ import annotations

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
from mlxformer.engine.choices import Picked, choice
from mlxformer.engine.decode_step import DecodeStep, Decoded
from mlxformer.engine.delivery import Delivery
from mlxformer.engine.departures import Departures
from mlxformer.engine.handle import RequestHandle
from mlxformer.engine.jobs import Jobs
from mlxformer.engine.memory import BLOCK, KVSizer, MemoryPlanner, resolve_budget
from mlxformer.engine.metrics import EngineMetrics
from mlxformer.engine.parts import EngineParts
from mlxformer.engine.prefix_sharing import PrefixSharing
from mlxformer.engine.prompt_cache import PromptCacheSettings, build_prefix_cache
from mlxformer.engine.replay import Replays
from mlxformer.engine.request_state import GenerationRequest, RequestState, Status, check_request
from mlxformer.engine.scheduler import Chunk, EngineNotRunning, Scheduler, Step
from mlxformer.engine.working_set import engine_reserve
from mlxformer.generation.decoding import with_rewind
from mlxformer.generation.steps import default_prefill_step
from mlxformer.models.decoder import Model
from mlxformer.speculative.speculator import SpeculativeSettings, check_draft
from mlxformer.text.tokenizer import Tokenizer

log = logging.getLogger("mlxformer.engine")
T = TypeVar("T")


class Engine:
    """Continuous-batching generation over one model: see the module docstring of ``mlxformer.engine``.

    ``speculative``: decode every request (unless it sets ``speculate=False`` or has a constraint)
    speculatively; each one's proposals are verified on its pool row, in the step's packed
    forward or alone (its ``DecodingState`` decides the round and ``settle``s them).
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
        if speculative is not None:
            check_draft(speculative, tokenizer)
        self.cache_settings = with_rewind(cache_settings, speculative) or CacheSettings()
        warm_up(model, speculative.draft_model if speculative is not None else None, self.cache_settings)
        draft_tokens = speculative.num_draft_tokens if speculative is not None else 0
        self.budget = resolve_budget(model, max_kv_memory)
        self.scheduler = Scheduler(max_batch, max_queue, default_prefill_step() if prefill_chunk is None else prefill_chunk, step_tokens,
                                   aligned=any(layer.recurrent or layer.window for layer in model.layers))
        self.runner = BatchRunner(model)
        self.runner.staged = self.budget is not None  # a request's peak is then its own size (memory.py)
        self.runner.max_rows = max_batch  # a pool's spare rows (cache/pool.py)
        self.runner.prefill_chunk = self.scheduler.prefill_chunk  # a rotating row's slots past its window
        self.sizer = KVSizer(model, self.cache_settings, draft_tokens, self.runner.row_key)
        kv_dtype = self.sizer.dtype  # ``Model.kv_dtype``
        self.planner = MemoryPlanner(self.sizer, self.budget, draft_tokens)
        # ``prompt_cache``: the tiers (memory budget, disk directory); else memory of ``prefix_cache_bytes``
        tiers = prompt_cache or PromptCacheSettings(memory_bytes=prefix_cache_bytes)
        self.prefix_cache = build_prefix_cache(model, tokenizer, self.cache_settings, tiers, kv_dtype)
        self.sharing = PrefixSharing(self.prefix_cache, tiers.share_prefills)
        self.metrics = EngineMetrics(metrics)
        self.replays = Replays()  # preempted sequences catching up
        self.parts = EngineParts(model, self.scheduler, self.runner, self.planner, self.budget, self.prefix_cache,
                                 self.sharing, self.replays, self.metrics)
        self.departures = Departures(self.parts)
        self.delivery = Delivery(self.parts, self.departures)
        self.admission = Admission(self.parts, self.departures, self.delivery, self.cache_settings, speculative)
        self.decoding = DecodeStep(self.parts, self.departures, self.delivery)
        if self.budget is not None:  # a step's activations beside the KV (MLX's buffer cache is bounded by it)
            self.budget.reserve = engine_reserve(model.args, self.budget.limit, self.sizer.bytes_for(BLOCK) / BLOCK,
                                                 self.scheduler.step_tokens, self.scheduler.prefill_chunk, max_batch,
                                                 draft_tokens, kv_dtype.size)
        self.metrics.watch(lambda: len(self.scheduler.waiting), lambda: len(self.scheduler.active), lambda: self.held_kv,
                           self.budget.limit if self.budget is not None else 0)
        self.metrics.step_reserve.set(self.budget.reserve if self.budget is not None else 0)
        self.held_kv = 0  # KV bytes held after the last step (``kv_bytes``), for the metrics thread
        self.jobs = Jobs()  # embedding/rerank forwards, run between steps (``run_job``)
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
                self.departures.end(sequence, "cancelled")
            for handle in list(self.parts.handles.values()):  # e.g. the loop ended before they were admitted
                self.departures.end(handle.sequence, "cancelled")
            self._drop_work(EngineNotRunning("the engine stopped"))
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
        check_request(request, self.model.args.vocab_size)
        request = self.planner.fitted(request)
        self.planner.check(request)
        sequence = RequestState(request, self.tokenizer.detokenizer(), self.tokenizer.eos_token_ids)
        self.model.args.check_positions(len(request.prompt_ids), request.max_tokens)  # (max_tokens checked)
        sequence.cache_salt = cache_salt(self.model, request.adapters)
        handle = RequestHandle(sequence, self._notify)
        with self._wake:
            if not self.running:
                raise EngineNotRunning("the engine is not running (call start() first; it is stopped, or its thread ended)")
            self.parts.handles[id(sequence)] = handle  # before the loop can see the sequence: no event is missed
            try:
                self.scheduler.add(sequence)
            except Exception:
                del self.parts.handles[id(sequence)]
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
        return len(self.scheduler.active)

    def kv_bytes(self) -> int:
        """KV bytes held now: every active sequence's share of its pool, and the prefix cache."""
        return self.parts.kv_bytes()

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
            self._drop_work(error)
            for handle in list(self.parts.handles.values()):
                handle.sequence.finish("error")
                self.parts.handles.pop(id(handle.sequence), None)
                handle._put(error=error)

    def _drop_work(self, error: BaseException) -> None:
        """Forget the work in flight (the caller tells its requests): the queued jobs fail with
        ``error``; the tokens in flight, the pools (their rows' sequences have ended; their
        buffers were built on the loop thread's streams), the held newcomers, the queues and the
        replays go."""
        self.jobs.fail_all(error)
        self.delivery.pipeline = None
        self.runner.reset()
        self.sharing.waiting.clear()
        self.scheduler.clear()
        self.replays.clear()

    def step(self) -> None:
        """One engine step: drop cancelled, admit, fit the step into the KV budget, run the
        prompt chunks and the decode step, hand out."""
        admission, departures, scheduler = self.admission, self.departures, self.scheduler
        before = admission.kv_fingerprint()
        cancelled = [s for s in scheduler.active if s.cancelled]
        for sequence in scheduler.drop_cancelled_waiting() + cancelled:
            departures.end(sequence, "cancelled")
        for sequence in scheduler.admit(lambda s: self.planner.admissible(scheduler, s)):
            self.sharing.waiting.append(sequence)  # until the blocks it shares with a running prefill are cached
        for sequence in self.sharing.ready(scheduler.prefilling):
            try:
                admission.seat(sequence)
            except Exception as exc:  # e.g. a draft model's cache
                departures.fail(sequence, exc)
        step = admission.fit(scheduler.plan(skip=self.sharing.waiting))
        admission.widen(step)
        self._run(step)
        admission.drop_freed(before, prompted=bool(step.prefill))
        self.held_kv = self.kv_bytes()  # what the metrics read (never the caches the engine swaps)

    def _run(self, step: Step) -> None:
        """Build the step (its decode rows fed the last step's tokens where they are pending),
        then hand out: overlapped, the decode rows' choices are queued and the last step's read
        (``Delivery.hand_out``); a step whose choices must be read now (a first token, a
        speculation round, a constraint's next mask, a row rerun alone) reads the last step's
        and its own."""
        decode, rounds = self.decoding.propose(step.decode)
        # chunks in the decode step's forward (a scored prompt needs every position's logits: its own)
        riding = [c for c in step.prefill if c.sequence.prompt_scores is None and c.sequence.packs]
        packing = [r for r in rounds if r.sequence.packs]  # speculation rounds too: their rows written before any is read
        decoded = self.decoding.run(decode, riding, packing)
        batched = [] if decoded.alone else decoded.choices  # queued for the next step's read when they can wait
        now: list[Picked] = decoded.choices if decoded.alone else []  # to read in this step
        for sequence, proposed in rounds:
            if sequence.status is not Status.RUNNING:  # preempted after its round failed in the step
                continue
            try:
                logits = decoded.round_logits.get(id(sequence))
                if logits is None:
                    logits = self.runner.verify(sequence.last_token, proposed, sequence.cache, sequence.adapters)
                tokens, logprobs = sequence.verify(logits)
                now.append(choice([sequence] * len(tokens), mx.array(tokens), logprobs))
            except Exception as exc:
                self.departures.fail(sequence, exc)
        for chunk in step.prefill:
            now += self._prefill(chunk, decoded)
        waits = self.overlap and not now and all(s.constraint is None and s.speculator is None
                                                  for c in batched for s in c.sequences)
        if waits:
            self.delivery.hand_out(batched, [])
        else:
            self.delivery.hand_out([], batched + now)

    def _prefill(self, chunk: Chunk, decoded: Decoded) -> list[Picked]:
        """Run one prompt chunk (unless it rode in the decode step's forward); the first token's
        choice once the prompt is done."""
        sequence = chunk.sequence
        if sequence.status is not Status.PREFILLING:  # failed (or preempted) at an earlier chunk
            return []
        try:
            with select(self.model, [(sequence, 1)]):
                logits = decoded.chunk_logits[id(chunk)] if id(chunk) in decoded.chunk_logits else self.runner.prefill(
                    chunk.tokens, sequence.cache, chunk.last, len(sequence.prompt), sequence.prompt_scores,
                    sequence.processed)
            sequence.processed += len(chunk.tokens)
            self.metrics.prefilled_tokens.inc(len(chunk.tokens))
            self.sharing.publish(sequence)  # its blocks for those waiting on the same prefix
        except Exception as exc:
            self.departures.fail(sequence, exc)
            return []
        if logits is None:
            return []
        self.scheduler.start_decoding(sequence)
        if sequence.generated:  # resumed after preemption: its next token is known
            self.replays.start(sequence, 0)
            return []
        mx.async_eval(logits)
        return self.delivery.choose([sequence], logits)
