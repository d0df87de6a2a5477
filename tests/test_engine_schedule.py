"""The engine's step as a token budget (chunked prefill as in vLLM / Sarathi-Serve): a short
request is not queued behind a long prompt's prefill, several prompts prefill in one step, and
every output equals the one the prompt gets alone through ``stream_generate``."""

from __future__ import annotations

import random
import threading
import time

from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlxformer import stream_generate
from mlxformer.cache import CacheSettings, make_cache
from mlxformer.engine import Engine, GenerationRequest
from mlxformer.engine.batch_runner import BatchRunner, TokenRun
from mlxformer.engine.scheduler import Scheduler
from mlxformer.engine.request_state import RequestState, Status
from test_batch_step import tiny_gemma3  # noqa: F401  (a fixture: sliding-window and global layers)

CHUNK = 64


def alone(model, tokenizer, request: GenerationRequest, settings=None) -> list[int]:
    """The tokens ``request`` gets alone (``stream_generate``, prompt cut in ``CHUNK``s)."""
    return [r.token for r in stream_generate(model, tokenizer, request.prompt_ids, request.max_tokens,
                                             cache_settings=settings, prefill_step_size=CHUNK)]


def test_a_short_request_is_not_queued_behind_a_long_prefill(tiny_byte_llama):
    """A short request sent while a 3,000-token prompt prefills gets its first token before the
    long one, within two engine steps of its arrival (before: after the whole prefill, ~12
    steps of 256 tokens later); both outputs equal each one alone."""
    model, tokenizer = tiny_byte_llama
    rng = random.Random(0)
    long = GenerationRequest([rng.randrange(256) for _ in range(3000)], max_tokens=3)
    short = GenerationRequest(tokenizer.encode("Hi there"), max_tokens=3)
    steps = 0
    with Engine(model, tokenizer, prefill_chunk=CHUNK, step_tokens=256, prefix_cache_bytes=0) as engine:
        step = engine.step

        def counted_step() -> None:  # a step takes at least 20 ms: the test thread sees the prefill going
            nonlocal steps
            begun = time.monotonic()
            step()
            steps += 1
            time.sleep(max(0.0, 0.02 - (time.monotonic() - begun)))

        engine.step = counted_step  # type: ignore[method-assign]
        long_handle = engine.submit(long)
        long_sequence = long_handle.sequence
        for _ in range(2000):  # until the long prompt is well into its prefill
            if long_sequence.processed >= 512:
                break
            time.sleep(0.005)
        assert long_sequence.status is Status.PREFILLING
        sent_at = steps
        short_handle = engine.submit(short)
        first = next(iter(short_handle))
        first_at, long_done = steps, long_sequence.processed
        short_tokens = [first.token] + [e.token for e in short_handle if e.token is not None]
        long_tokens = [e.token for e in long_handle if e.token is not None]
    assert long_done < len(long.prompt_ids), "the short request's first token came after the long prefill"
    assert first_at - sent_at <= 2, (sent_at, first_at)
    assert short_tokens == alone(model, tokenizer, short)
    assert long_tokens == alone(model, tokenizer, long)


def test_the_plan_fills_the_budget_decode_rows_first():
    """Decode rows count one token each; chunks go round by round, newcomers then the shortest
    remaining prompt first, cut as alone (full chunks, then the rest); the first chunk runs
    even over the budget."""
    def sequence(length: int, processed: int = 0) -> RequestState:
        s = RequestState(GenerationRequest(list(range(1, length + 1))), detokenizer=None, eos_ids=[])  # type: ignore[arg-type]
        s.processed = processed
        return s

    scheduler = Scheduler(max_batch=8, max_queue=8, prefill_chunk=64, step_tokens=200)
    running = [sequence(10) for _ in range(8 - 3)]
    scheduler.running = running
    long, short, middle = sequence(1000, 128), sequence(20), sequence(100)
    scheduler.prefilling = [long, short, middle]
    step = scheduler.plan()
    assert step.decode == running
    # budget 200 - 5 decode rows = 195: round 1 gives short 20, middle 64, long 64 (47 left);
    # round 2: middle's last 36 fit, long's next 64 does not
    assert [(c.sequence, len(c.tokens), c.last) for c in step.prefill] == [
        (short, 20, True), (middle, 64, False), (long, 64, False), (middle, 36, True)]
    assert step.prefill[2].tokens == long.prompt[128:192]
    assert step.prefill[3].tokens == middle.prompt[64:100]
    scheduler.step_tokens = 3  # fewer tokens than decode rows: one chunk still runs
    step = scheduler.plan(skip=[short])
    assert [(c.sequence, len(c.tokens)) for c in step.prefill] == [(middle, 64)]
    scheduler.running, scheduler.step_tokens = [], 64  # one chunk a step: a newcomer goes first
    nearly_done, newcomer = sequence(1000, 960), sequence(3000)
    scheduler.prefilling = [nearly_done, newcomer]
    assert [c.sequence for c in scheduler.plan().prefill] == [newcomer]


SETTINGS = {
    "float": None,
    "kv8": CacheSettings(kv_bits=8, kv_group_size=32),
    "rotating": CacheSettings(max_kv_size=48, keep=4),
}


@pytest.mark.parametrize("model_name,cache", [("llama", "float"), ("llama", "kv8"), ("llama", "rotating"),
                                              ("gemma3", "float"), ("gemma3", "kv8"),
                                              ("mla", "float"), ("mla", "kv8"), ("mla", "rotating")])
def test_prompts_prefilled_together_equal_each_alone(request, model_name, cache):
    """Prompts of different lengths prefilling in the same steps (a budget that holds several
    chunks, packed into the decode rows' forward), one of them with a prefix cached by an
    earlier request, on a Llama, on a Gemma 3 (sliding-window and global layers) and on an MLA
    model (DeepSeek-V2's latent attention), with float, 8-bit and rotating caches: each output
    equals alone."""
    model, tokenizer = request.getfixturevalue({"llama": "tiny_byte_llama", "gemma3": "tiny_gemma3",
                                                "mla": "tiny_mla"}[model_name])
    settings = SETTINGS[cache]
    rng = random.Random(1)
    base = [rng.randrange(256) for _ in range(200)]
    prompts = [base + [rng.randrange(256) for _ in range(40)], [rng.randrange(256) for _ in range(300)],
               tokenizer.encode("abc"), [rng.randrange(256) for _ in range(90)]]
    requests = [GenerationRequest(p, max_tokens=6 + i) for i, p in enumerate(prompts)]
    with Engine(model, tokenizer, cache_settings=settings, prefill_chunk=CHUNK, step_tokens=3 * CHUNK) as engine:
        first = GenerationRequest(base, max_tokens=2)
        assert [e.token for e in engine.submit(first) if e.token is not None] == alone(model, tokenizer, first, settings)
        handles = [engine.submit(r) for r in requests]
        events = [list(h) for h in handles]
    for request_, got in zip(requests, events):
        assert [e.token for e in got if e.token is not None] == alone(model, tokenizer, request_, settings)
    if model_name == "llama" and cache != "rotating":  # a rotating cache that evicted is reused only whole
        assert events[0][-1].cached_tokens > 0  # the first prompt's prefix came from the prefix cache


class Counting:
    """``model`` counting its forward passes."""

    def __init__(self, model) -> None:
        self.model, self.forwards = model, 0
        self.layers, self.cache_layers, self.args = model.layers, model.cache_layers, model.args

    def hidden_states(self, *args, **kwargs):
        self.forwards += 1
        return self.model.hidden_states(*args, **kwargs)

    def last_logits(self, *args, **kwargs):
        self.forwards += 1
        return self.model.last_logits(*args, **kwargs)

    def logits(self, hidden):
        return self.model.logits(hidden)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


@pytest.fixture(scope="module")
def tiny_gemma4(tmp_path_factory):
    """Gemma 4 E2B-like (``test_zero_copy_join.GEMMA4``): sliding (16) and global layers, the
    last two reading the keys/values of earlier layers (``num_kv_shared_layers``)."""
    from test_zero_copy_join import sliding_model

    return sliding_model(tmp_path_factory.mktemp("gemma4"), "gemma4", 16, layers=5)


def tiny_hybrid(tmp_path_factory, family: str):
    """Qwen3.5 / Qwen3-Next: Gated DeltaNet layers (a recurrent state per sequence) between
    attention layers (``test_zero_copy_hybrid``'s shapes)."""
    from test_zero_copy_hybrid import tiny

    return tiny(tmp_path_factory.mktemp(family), family)


@pytest.fixture(scope="module")
def tiny_qwen3_5(tmp_path_factory):
    return tiny_hybrid(tmp_path_factory, "qwen3_5_text")


@pytest.fixture(scope="module")
def tiny_qwen3_next(tmp_path_factory):
    return tiny_hybrid(tmp_path_factory, "qwen3_next")


@pytest.fixture(scope="module")
def tiny_mla(tmp_path_factory):
    """DeepSeek-V2-like multi-head latent attention (``test_zero_copy_join.MLA``)."""
    from test_zero_copy_join import MLA, tiny_model

    return tiny_model(tmp_path_factory.mktemp("mla"), "deepseek_v2", **MLA)


@pytest.mark.parametrize("family", ["tiny_byte_llama", "tiny_gemma4", "tiny_qwen3_5", "tiny_qwen3_next", "tiny_mla"])
def test_decode_rows_and_prompt_chunks_run_in_one_forward(family, request):
    """Two decoding rows of different lengths and three prompt chunks (two of one prompt) run
    in one forward; every logit row is the one the sequence gets from a forward of its own
    over all its tokens. Gemma 4's KV-shared layers too: a layer reading another's keys/values
    attends over what that layer's segments wrote, nothing written twice; hybrids' recurrent
    layers, each segment scanning from its own state; and MLA's latent attention, its chunk of
    64 in the expanded form (before, each ran a forward per batch and per chunk)."""
    model, _ = request.getfixturevalue(family)
    counting = Counting(model)
    runner = BatchRunner(counting)  # type: ignore[arg-type]
    rows = []
    for i, length in enumerate((30, 45)):
        row = SimpleNamespace(cache=make_cache(model, CacheSettings()), speculator=None, last_token=7 + i)
        runner.seat(row)  # its row of the pool, where its prompt is written
        runner.prefill(list(range(1, length)), row.cache, want_logits=False)
        rows.append(row)
    mx.eval(runner.decode(rows))  # their first decode step
    prompt_a, prompt_b = list(range(10, 110)), list(range(50, 57))
    cache_a, cache_b = make_cache(model, CacheSettings()), make_cache(model, CacheSettings())
    chunks = [TokenRun(prompt_a[:64], cache_a, False, 100), TokenRun(prompt_b, cache_b, True, 7),
              TokenRun(prompt_a[64:], cache_a, True, 100)]
    counting.forwards = 0
    logits, chunk_logits = runner.step(rows, chunks)
    assert counting.forwards == 1
    assert chunk_logits[0] is None
    for prompt, got in ((prompt_b, chunk_logits[1]), (prompt_a, chunk_logits[2])):
        want = model.last_logits(mx.array(prompt)[None], make_cache(model, CacheSettings()))
        assert got is not None and mx.allclose(got, want, atol=1e-5).item()
    assert [c.offset for c in cache_a + cache_b] == [100] * len(cache_a) + [7] * len(cache_b)  # each written once
    for i, length in enumerate((30, 45)):  # the rows: the prefix, the joined token, then this step's token
        want = model.last_logits(mx.array(list(range(1, length)) + [7 + i, 7 + i])[None], make_cache(model, CacheSettings()))
        assert mx.allclose(logits[i : i + 1], want, atol=1e-4).item()
