"""Error boundaries and the engine's lifecycle: an exception in one sequence's prefill, batched
decode step, constraint or detokenizer fails that request alone, and the other seven of eight
concurrent requests give what each gives alone through ``generate``; ``submit`` on an engine
that is not running raises; ``stop`` leaves nothing queued; a handle gets every event however
fast the engine is; a stopped engine starts again; ``/health`` answers 503 once the engine's thread is dead."""

from __future__ import annotations

import itertools
import threading
import time

import mlx.core as mx
import pytest

from conftest import write_byte_tokenizer, write_tiny_checkpoint
from mlxformer import generate, load
from mlxformer.cache import CacheSettings
from mlxformer.engine import Engine, EngineNotRunning, GenerationRequest
from server_support import http, running_server

POISON = 255  # the token that marks the poisoned prompt
PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(10 + 5 * i)] for i in range(8)]
MAX_TOKENS = 12
CHUNK = 16
POISONED = 3  # which of the eight requests fails
CACHES = {"float": None, "rotating": CacheSettings(max_kv_size=20, keep=2)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with a byte tokenizer and no end-of-sequence token."""
    directory, _ = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_faults"), "llama")
    write_byte_tokenizer(directory)
    model, tokenizer = load(directory, dtype=mx.float32)
    tokenizer.eos_token_ids = []
    return model, tokenizer


@pytest.fixture(scope="module")
def alone(tiny):
    """Each prompt's greedy completion alone (``generate``), by cache setting."""
    model, tokenizer = tiny
    return {
        name: [generate(model, tokenizer, p, MAX_TOKENS, cache_settings=settings, prefill_step_size=CHUNK)
               for p in PROMPTS]
        for name, settings in CACHES.items()
    }


class FaultyDetokenizer:
    """A detokenizer that fails on its fourth token."""

    def __init__(self, inner) -> None:
        self.inner, self.count = inner, 0

    def add_token(self, token: int) -> str:
        self.count += 1
        if self.count == 4:
            raise RuntimeError("injected detokenizer fault")
        return self.inner.add_token(token)

    def finalize(self) -> str:
        return self.inner.finalize()


class FaultyConstraint:
    """A constraint allowing every token that fails on its third mask."""

    def __init__(self) -> None:
        self.count, self.done = 0, False

    def next_mask(self):
        self.count += 1
        if self.count == 3:
            raise RuntimeError("injected constraint fault")
        return None

    def advance(self, token: int) -> None:
        pass


def poison(stage: str, engine: Engine, monkeypatch) -> None:
    """Make ``stage`` fail for the sequence whose prompt holds ``POISON`` (the detokenizer: the
    ``POISONED``-th request's)."""
    runner = engine.runner
    real_step = runner.step
    if stage == "prefill":  # a chunk alone (``prefill``) or in a step's forward (``step``)
        real_prefill = runner.prefill

        def prefill(tokens, *args):
            if POISON in tokens:
                raise RuntimeError("injected prefill fault")
            return real_prefill(tokens, *args)

        def prefill_step(sequences, chunks=(), inputs=None):
            outputs = real_step(sequences, chunks, inputs)  # every layer's cache is written, then the step fails
            if any(POISON in c.tokens for c in chunks):
                raise RuntimeError("injected prefill fault")
            return outputs

        monkeypatch.setattr(runner, "prefill", prefill)
        monkeypatch.setattr(runner, "step", prefill_step)
    elif stage == "decode":  # ``decode`` (rows rerun alone) runs a ``step`` too

        def decode_step(sequences, chunks=(), inputs=None):
            outputs = real_step(sequences, chunks, inputs)  # every layer's cache is written, then the step fails
            if any(POISON in s.prompt and len(s.generated) >= 3 for s in sequences):
                raise RuntimeError("injected decode fault")
            return outputs

        monkeypatch.setattr(runner, "step", decode_step)
    elif stage == "publish":  # offering a prefilled chunk's blocks to requests waiting on the prefix
        real_publish = engine.sharing.publish

        def publish(sequence):
            if POISON in sequence.prompt:
                raise RuntimeError("injected publish fault")
            return real_publish(sequence)

        monkeypatch.setattr(engine.sharing, "publish", publish)
    elif stage == "retire":  # keeping a finished request's cache for prefix reuse
        real_insert = engine.prefix_cache.insert

        def insert(tokens, caches, *keys):
            if POISON in tokens:
                raise RuntimeError("injected retire fault")
            return real_insert(tokens, caches, *keys)

        monkeypatch.setattr(engine.prefix_cache, "insert", insert)
    elif stage == "detokenizer":
        made = engine.tokenizer.detokenizer
        calls = itertools.count()
        monkeypatch.setattr(engine.tokenizer, "detokenizer",
                            lambda: FaultyDetokenizer(made()) if next(calls) == POISONED else made())


@pytest.mark.parametrize("stage,cache", [
    ("prefill", "float"), ("decode", "float"), ("decode", "rotating"), ("constraint", "float"), ("detokenizer", "float"),
    ("publish", "float"), ("retire", "float"),
])
def test_one_poisoned_request_of_eight_fails_alone(tiny, alone, stage, cache, monkeypatch):
    """A failed decode step is rolled back (also in rotating caches that have evicted) and rerun
    sequence by sequence."""
    model, tokenizer = tiny
    with Engine(model, tokenizer, max_batch=8, prefill_chunk=CHUNK, cache_settings=CACHES[cache],
                prefix_cache_bytes=0) as engine:
        poison(stage, engine, monkeypatch)
        handles = []
        for i, prompt in enumerate(PROMPTS):
            ids = [POISON, *prompt] if i == POISONED and stage in ("prefill", "decode", "publish", "retire") else prompt
            constraint = FaultyConstraint() if i == POISONED and stage == "constraint" else None
            handles.append(engine.submit(GenerationRequest(ids, MAX_TOKENS, constraint=constraint)))
        for i, handle in enumerate(handles):
            if i == POISONED and stage == "retire":  # the reply was whole: only its cache is not kept
                assert [e.finish_reason for e in handle][-1] == "length"
            elif i == POISONED:
                with pytest.raises(RuntimeError, match=f"injected {stage} fault"):
                    list(handle)
            else:
                assert "".join(e.text for e in handle) == alone[cache][i]
        assert engine.running and engine.active == 0  # the engine goes on
        again = engine.submit(GenerationRequest(PROMPTS[0], MAX_TOKENS))
        assert "".join(e.text for e in again) == alone[cache][0]


def test_submit_needs_a_running_engine(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer)
    request = GenerationRequest(PROMPTS[0], 2)
    with pytest.raises(EngineNotRunning):
        engine.submit(request)
    with engine:
        assert len(list(engine.submit(request))) == 2
    with pytest.raises(EngineNotRunning):
        engine.submit(request)


def test_a_stopped_engine_starts_again(tiny, alone):
    """Its batches and prefix cache were built on the ended thread's streams: the new thread
    must not inherit lazy arrays bound to them (MLX: "There is no Stream(cpu, N)")."""
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, prefill_chunk=CHUNK)
    for _ in range(2):  # the same prompts again: the second run hits the prefix cache
        with engine:
            handles = [engine.submit(GenerationRequest(p, MAX_TOKENS)) for p in PROMPTS[:3]]
            texts = ["".join(e.text for e in h) for h in handles]
        assert texts == alone["float"][:3]


def test_stop_ends_waiting_requests(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, max_batch=1).start()
    handles = [engine.submit(GenerationRequest(PROMPTS[i], 10_000)) for i in range(3)]
    next(iter(handles[0]))
    engine.stop()
    assert not engine.scheduler.has_work() and not engine.scheduler.waiting
    assert [list(h)[-1].finish_reason for h in handles[1:]] == ["cancelled", "cancelled"]


def test_handle_gets_its_first_events(tiny, monkeypatch):
    """The engine, in the middle of a step, admits and serves a request that ``submit`` has just
    queued but not yet returned: the handle must still get the first token's event."""
    model, tokenizer = tiny
    with Engine(model, tokenizer) as engine:
        busy = engine.submit(GenerationRequest(PROMPTS[0], 10_000))  # keeps the engine stepping
        next(iter(busy))
        entered, added = threading.Event(), threading.Event()
        real_admit, real_add = engine.scheduler.admit, engine.scheduler.add

        def admit(fits=lambda s: True):
            entered.set()
            added.wait(timeout=5)  # mid-step, until the request is queued
            return real_admit(fits)

        def add(sequence):
            real_add(sequence)
            added.set()
            time.sleep(0.5)  # the engine admits, prefills and emits meanwhile

        monkeypatch.setattr(engine.scheduler, "admit", admit)
        monkeypatch.setattr(engine.scheduler, "add", add)
        entered.clear()
        assert entered.wait(timeout=5)
        handle = engine.submit(GenerationRequest(PROMPTS[1], 3))
        events: list = []
        reader = threading.Thread(target=lambda: events.extend(handle), daemon=True)
        reader.start()
        reader.join(timeout=10)
        busy.cancel()
        assert [e.token is not None for e in events] == [True, True, True]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_is_503_when_the_engine_thread_died(tiny, monkeypatch):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer).start()
    try:
        with running_server(engine, model, tokenizer) as url:
            assert http(url, "GET", "/health")[0] == 200

            def die() -> None:
                raise SystemExit("injected: the engine thread ends")

            monkeypatch.setattr(engine, "step", die)
            handle = engine.submit(GenerationRequest(PROMPTS[0], 5))
            with pytest.raises(EngineNotRunning):
                list(handle)
            status, _, body = http(url, "GET", "/health")
            assert status == 503 and b"engine" in body
            status, _, _ = http(url, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
            assert status == 503
    finally:
        engine.stop()
