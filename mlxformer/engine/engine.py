"""The engine: a background thread that loops schedule -> run -> postprocess, and the handles
through which callers submit requests, iterate (or await) their tokens and cancel them."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections import deque
from typing import Any, AsyncIterator, Iterator, Sequence as Seq

import mlx.core as mx

from mlxformer.cache import CacheSettings, make_cache
from mlxformer.engine.batch_runner import BatchRunner
from mlxformer.engine.prefix_sharing import PrefixSharing
from mlxformer.engine.prompt_cache import PromptCacheSettings, build_prefix_cache
from mlxformer.engine.scheduler import Scheduler, Step
from mlxformer.engine.speculation import Speculator
from mlxformer.engine.sequence import (
    GenerationRequest, Sequence, Status, TokenEvent, check_request, choose_rows,
)
from mlxformer.generation import SamplingSettings
from mlxformer.sampling import make_distribution
from mlxformer.speculative import SpeculativeSettings, check_draft, new_proposer
from mlxformer.steps import default_prefill_step
from mlxformer.models.decoder import Model
from mlxformer.tokenizer import Tokenizer


class RequestHandle:
    """A submitted request: iterate it (``for event in handle``, or ``async for`` over
    ``handle.aiter()``) to get its ``TokenEvent``s; ``cancel()`` ends it and frees its slot."""

    def __init__(self, engine: "Engine", sequence: Sequence) -> None:
        self._engine = engine
        self.sequence = sequence
        self._events: deque[TokenEvent] = deque()
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    # called on the engine thread
    def _put(self, event: TokenEvent | None = None, error: BaseException | None = None) -> None:
        with self._cond:
            if event is not None:
                self._events.append(event)
            if error is not None:
                self._error = error
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, ready in waiters:
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:  # the loop was closed
                pass

    def _pop(self) -> TokenEvent | None:
        """The next event if any; raises the engine's error once the events are drained."""
        if self._events:
            return self._events.popleft()
        if self._error is not None:
            raise self._error
        return None

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            with self._cond:
                while (event := self._pop()) is None:
                    self._cond.wait()
            yield event
            if event.finish_reason is not None:
                return

    async def aiter(self) -> AsyncIterator[TokenEvent]:
        """The events as an async iterator (woken by the engine thread, no polling)."""
        ready = asyncio.Event()
        waiter = (asyncio.get_running_loop(), ready)
        with self._cond:
            self._waiters.append(waiter)
        try:
            while True:
                ready.clear()
                with self._cond:
                    event = self._pop()
                if event is None:
                    await ready.wait()
                    continue
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            with self._cond:
                self._waiters.remove(waiter)

    def cancel(self) -> None:
        """Stop generating: the slot is freed before the engine's next step and the last event
        has ``finish_reason == "cancelled"`` (unless the request had already finished)."""
        self.sequence.cancelled = True
        self._engine._notify()


class Engine:
    """Continuous-batching generation over one model: see the module docstring of ``mlxformer.engine``.

    ``speculative``: decode every request (unless it sets ``speculate=False`` or has a constraint)
    speculatively; each one's proposals are verified in its own pass (``engine/speculation.py``)."""

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
        speculative: SpeculativeSettings | None = None,
        prompt_cache: PromptCacheSettings | None = None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.cache_settings = cache_settings or CacheSettings()
        self.speculative = speculative
        if speculative is not None:  # rotating caches keep enough beyond their window to rewind a round
            check_draft(speculative, tokenizer)
            self.cache_settings = dataclasses.replace(self.cache_settings, rewind=speculative.num_draft_tokens)
        # Validate the settings in the caller's thread, and run one token through the model(s)
        # there: MLX arrays made lazily in a thread (weight views, for example) can only be
        # evaluated by that thread, so the engine's thread must find them all evaluated.
        for warm in (speculative.draft_model if speculative is not None else None, model):
            if warm is not None:
                probe = make_cache(warm, self.cache_settings)
                mx.eval(warm.last_logits(mx.array([[0]]), probe))
        kv_dtype = next(a.dtype for a in probe[0].state if mx.issubdtype(a.dtype, mx.floating))  # the model's
        self.scheduler = Scheduler(max_batch, max_queue, prefill_chunk or default_prefill_step())
        # ``prompt_cache`` sets the tiers (memory budget, disk directory); without it the memory
        # tier gets ``prefix_cache_bytes``
        tiers = prompt_cache or PromptCacheSettings(memory_bytes=prefix_cache_bytes)
        self.prefix_cache = build_prefix_cache(model, tokenizer, self.cache_settings, tiers, kv_dtype)
        self.sharing = PrefixSharing(self.prefix_cache, tiers.share_prefills)
        self.prefilled_tokens = 0  # prompt tokens run through the model (not served by the prefix cache)
        self.runner = BatchRunner(model)
        self.vocab_size = model.args.vocab_size
        self._handles: dict[int, RequestHandle] = {}
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # --- public API ---------------------------------------------------------------------

    def start(self) -> "Engine":
        """Start the background loop (idempotent)."""
        with self._wake:
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                self._thread = threading.Thread(target=self._loop, name="mlxformer-engine", daemon=True)
                self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the loop and join it; requests still in flight end as cancelled."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        self._thread = None
        for handle in list(self._handles.values()):
            self._end(handle.sequence, "cancelled")
        self.prefix_cache.flush()  # the disk tier's writes are done when stop returns

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue ``request``; raises ``EngineOverloaded`` when the queue is full and
        ``MlxformerError`` on an invalid request."""
        check_request(request, self.vocab_size)
        sequence = Sequence(request, self.tokenizer.detokenizer(), self.tokenizer.eos_token_ids)
        handle = RequestHandle(self, sequence)
        with self._wake:
            self.scheduler.add(sequence)
            self._handles[id(sequence)] = handle
            self._wake.notify_all()
        return handle

    @property
    def active(self) -> int:
        """Requests holding a batch slot."""
        return self.scheduler.active

    # --- the loop -------------------------------------------------------------------------

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def _loop(self) -> None:
        try:
            self._serve()
        finally:  # an MLX thread must release its streams before it ends, or exit may abort
            mx.clear_streams()

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self.scheduler.has_work():
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as exc:  # fail every request in flight, keep serving new ones
                self.runner.reset()
                self.sharing.held.clear()
                for handle in list(self._handles.values()):
                    self.scheduler.release(handle.sequence)
                    with self.scheduler.lock:
                        if handle.sequence in self.scheduler.waiting:
                            self.scheduler.waiting.remove(handle.sequence)
                    self._handles.pop(id(handle.sequence), None)
                    handle._put(error=exc)

    def step(self) -> None:
        """One engine step: drop cancelled, admit, run a prompt chunk and a decode step, emit."""
        for sequence in self.scheduler.drop_cancelled_waiting():
            self._end(sequence, "cancelled")
        for sequence in self.scheduler.prefilling + self.scheduler.running:
            if sequence.cancelled:
                self._end(sequence, "cancelled")
        for sequence in self.scheduler.admit():
            self.sharing.hold(sequence)  # until the blocks it shares with a running prefill are cached
        for sequence in self.sharing.ready(self.scheduler.prefilling):
            self._attach_cache(sequence)
        self._run(self.scheduler.plan(skip=self.sharing.held))

    def _attach_cache(self, sequence: Sequence) -> None:
        hit = self.prefix_cache.lookup(sequence.prompt)
        if hit is None:
            sequence.cache = make_cache(self.model, self.cache_settings)
        else:
            sequence.cache, sequence.cached_tokens = hit
            sequence.processed = sequence.cached_tokens
        request = sequence.request
        if self.speculative is not None and request.speculate and request.constraint is None:
            s = request.sampling
            distribution = None if sequence.greedy else make_distribution(s.temp, s.top_p, s.top_k, s.min_p)
            proposer = new_proposer(self.speculative, sequence.prompt, distribution, self.cache_settings,
                                    sequence.next_key)
            sequence.speculator = Speculator(proposer, self.speculative.num_draft_tokens, distribution,
                                             sequence.processors, sequence.next_key)

    def _run(self, step: Step) -> None:
        choices: list[tuple[Sequence, mx.array, mx.array]] = []
        decode, verifying = self._propose(step.decode)
        if decode:
            logits = self.runner.decode(decode)
            mx.async_eval(logits)  # constraints compute their masks while the step runs
            if all(s.plain_greedy for s in decode):
                choices += zip(decode, *zip(*choose_rows(decode, logits)))
            else:
                choices += self._choose_each(decode, [logits[i : i + 1] for i in range(len(decode))])
        for sequence, proposed in verifying:
            try:
                assert sequence.speculator is not None
                logits = self.runner.verify([sequence.last_token, *proposed], sequence.cache)
                choices += [(sequence, *c) for c in sequence.speculator.verify(logits, sequence.tokens)]
            except Exception as exc:
                self._fail(sequence, exc)
        for chunk in step.prefill:
            sequence = chunk.sequence
            logits = self.runner.prefill(chunk.tokens, sequence.cache, chunk.last, len(sequence.prompt))
            sequence.processed += len(chunk.tokens)
            self.prefilled_tokens += len(chunk.tokens)
            self.sharing.publish(sequence)
            if logits is not None:
                mx.async_eval(logits)
                self.scheduler.start_decoding(sequence)
                choices += self._choose_each([sequence], [logits])
        if choices:
            self._emit(choices)

    def _propose(self, running: list[Sequence]) -> tuple[list[Sequence], list[tuple[Sequence, list[int]]]]:
        """Split the running sequences into those decoding one token in the batch and those
        with proposals to verify (each with its proposals)."""
        decode, verifying = [], []
        for sequence in running:
            if sequence.speculator is None:
                decode.append(sequence)
                continue
            try:
                room = sequence.request.max_tokens - len(sequence.generated)
                proposed = sequence.speculator.propose(sequence.tokens, room)
            except Exception as exc:  # e.g. a draft model failing
                self._fail(sequence, exc)
                continue
            if proposed:
                verifying.append((sequence, proposed))
            else:
                decode.append(sequence)
        return decode, verifying

    def _choose_each(self, sequences: list[Sequence], logits: list[mx.array]) -> list[tuple[Sequence, mx.array, mx.array]]:
        """Each sequence's own choice; one whose processors or constraint fail ends alone."""
        choices = []
        for sequence, row in zip(sequences, logits):
            try:
                choices.append((sequence, *sequence.choose(row)))
            except Exception as exc:
                self._fail(sequence, exc)
        return choices

    def _emit(self, choices: list[tuple[Sequence, mx.array, mx.array]]) -> None:
        """Evaluate the chosen tokens (and logprobs asked for), record them, send the events."""
        picked = []
        for sequence, token, logprobs in choices:
            k = sequence.request.logprobs
            chosen = mx.take_along_axis(logprobs, token[:, None], axis=-1) if k is not None else None
            top_ids = mx.argsort(-logprobs, axis=-1)[:, :k] if k else None
            top_values = mx.take_along_axis(logprobs, top_ids, axis=-1) if top_ids is not None else None
            picked.append((sequence, token, chosen, top_ids, top_values))
        mx.eval([x for p in picked for x in p[1:] if x is not None])
        emitted: list[tuple[Sequence, TokenEvent]] = []
        for sequence, token, chosen, top_ids, top_values in picked:
            if sequence.status is Status.FINISHED:  # a stop ended it earlier in its speculation round
                continue
            top = None
            if top_ids is not None and top_values is not None:
                top = list(zip(top_ids[0].tolist(), top_values[0].tolist()))
            elif chosen is not None:
                top = []
            try:
                event = sequence.accept(int(token.item()), float(chosen.item()) if chosen is not None else None, top)
            except Exception as exc:  # e.g. a constraint refusing the token
                self._fail(sequence, exc)
                continue
            emitted.append((sequence, event))
        handles = {}
        for sequence in dict.fromkeys(s for s, _ in emitted):  # each sequence once, in order
            handles[id(sequence)] = self._handles.get(id(sequence))
            if sequence.speculator is not None and sequence.finish_reason != "error":
                try:  # its caches must hold exactly its tokens before the prefix cache keeps them
                    sequence.speculator.settle(sequence.cache, sequence.tokens, sequence.status is Status.FINISHED)
                except Exception as exc:
                    self._fail(sequence, exc)
                    continue
            if sequence.status is Status.FINISHED and sequence.finish_reason != "error":
                self._retire(sequence)
        for sequence, event in emitted:
            handle = handles.get(id(sequence))
            if handle is not None:
                handle._put(event)

    def _fail(self, sequence: Sequence, error: BaseException) -> None:
        """End one sequence with ``error`` (raised by its handle's iterator)."""
        sequence.finish("error")
        self.runner.release(sequence)
        self.scheduler.release(sequence)
        handle = self._handles.pop(id(sequence), None)
        if handle is not None:
            handle._put(error=error)

    def _retire(self, sequence: Sequence) -> None:
        """Free a finished sequence's slot and offer its cache for prefix reuse."""
        self.runner.release(sequence)
        self.scheduler.release(sequence)
        self._handles.pop(id(sequence), None)
        if sequence.cache:
            self.prefix_cache.insert(sequence.cache_tokens, sequence.cache)

    def _end(self, sequence: Sequence, reason: str) -> None:
        """End ``sequence`` early (cancelled) and tell its handle."""
        handle = self._handles.get(id(sequence))
        if sequence.status is not Status.WAITING:
            sequence.finish(reason)
            self._retire(sequence)
        else:
            sequence.finish(reason)
            self._handles.pop(id(sequence), None)
        if handle is not None:
            handle._put(sequence.event("", None))


def batch_generate(
    model: Model,
    tokenizer: Tokenizer,
    prompts: Seq[str | Seq[int]],
    max_tokens: int = 256,
    *,
    sampling: SamplingSettings = SamplingSettings(),
    stop: Seq[str] = (),
    cache_settings: CacheSettings | None = None,
    max_batch: int = 8,
    prefill_chunk: int | None = None,
    prefix_cache_bytes: int = 512 * 2**20,
    speculative: SpeculativeSettings | None = None,
    **sampling_kwargs: Any,
) -> list[str]:
    """Complete every prompt (raw text or token ids, no chat template) in one continuous batch;
    returns the completions in order. Sampling may be given as ``sampling=`` or as keywords
    (``temp``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``seed``);
    ``speculative`` decodes each sequence speculatively (same greedy output)."""
    if sampling_kwargs:
        sampling = dataclasses.replace(sampling, **sampling_kwargs)
    engine = Engine(
        model, tokenizer, max_batch=max_batch, max_queue=max(len(prompts), 1), cache_settings=cache_settings,
        prefix_cache_bytes=prefix_cache_bytes, prefill_chunk=prefill_chunk, speculative=speculative,
    )
    requests = [
        GenerationRequest(tokenizer.encode(p) if isinstance(p, str) else list(p), max_tokens, sampling, stop)
        for p in prompts
    ]
    with engine:
        handles = [engine.submit(r) for r in requests]
        return ["".join(event.text for event in handle) for handle in handles]
