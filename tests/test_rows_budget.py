"""KV in one place under a KV budget and for speculating sequences (issue 32): with
``--max-kv-memory`` a sequence is seated in its row of the decode batch at admission too (the
batch then holds no spare row: one row added per seat and removed per leave, each rewrite and
widening one layer at a time), and a speculating sequence lives in its row (its rounds write
``k + 1`` slots there, a rejection trims them). Checked with MLX's own peak-memory counter (the
old join, measured beside it in one graph, copies the batch), with the budget's
figures (a budget sized for N requests runs N at once, no preemption, the bytes held never over
it) and by greedy replies against ``stream_generate`` / ``generate`` alone."""

from __future__ import annotations

import mlx.core as mx
import pytest

from conftest import tiny_byte_llama_of
from mlxformer import generate
from mlxformer.cache import CacheSettings, make_cache
from mlxformer.cache.pool import RowCache, KVPool
from mlxformer.engine import Engine, GenerationRequest
from mlxformer.engine.batch_runner import BatchRunner
from mlxformer.engine.memory import BLOCK, KVBudgetExceeded, KVSizer, nbytes
from mlxformer.speculative.speculator import SpeculativeSettings, rewind
from test_zero_copy_join import (CHUNK, LAYERS, MLA, PROMPTS, TOKENS, alone, assert_join_copies_nothing,
                                 decode_rises, ids, in_turn, warm_up_decoding, plain_and_speculating, rotating_model,
                                 sliding_model, staggered, Stub, tiny_model, watch_rounds)

SETTINGS = [CacheSettings(), CacheSettings(kv_bits=8, kv_group_size=32)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_byte_llama_of(tmp_path_factory.mktemp("rows_budget"), LAYERS)


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """A one-layer draft with the same byte tokenizer."""
    return tiny_byte_llama_of(tmp_path_factory.mktemp("rows_budget_draft"), 1)


def seated_prefill(runner: BatchRunner, sequence: Stub, length: int) -> None:
    """Seat ``sequence`` and prefill ``length`` tokens into its row (chunks of the runner's
    ``prefill_chunk``, else 128), widening the rows before each chunk as the engine does under a
    budget (``Admission.grow``)."""
    runner.seat(sequence)
    prompt, size = ids(length, 3), runner.prefill_chunk or 128
    for start in range(0, length, size):
        chunk = prompt[start : start + size]
        if runner.staged:
            runner.reserve(sequence, len(chunk))
        runner.prefill(chunk, sequence.cache, want_logits=False)


@pytest.mark.parametrize("settings", SETTINGS, ids=["float", "kv8"])
def test_a_join_under_a_budget_copies_nothing(llama, settings):
    """Staged (a KV budget): two sequences seated at admission prefill in their rows; the step at
    which they join the decode steps raises MLX's peak as a steady step does, and the batch
    holds one row per seat (no spare row, though ``max_rows`` allows eight), as many bytes as
    their own caches would."""
    model, _ = llama
    caches = [make_cache(model, settings), make_cache(model, settings)]
    for cache, length in zip(caches, (300, 310)):
        BatchRunner(model).prefill(ids(length, 3), cache, want_logits=False)
    kv = sum(c.nbytes for cache in caches for c in cache)
    del caches
    warm_up_decoding(model, settings)

    runner = BatchRunner(model)
    runner.staged, runner.max_rows = True, 8
    rows = [Stub(make_cache(model, settings), 5), Stub(make_cache(model, settings), 6)]
    for sequence, length in zip(rows, (300, 310)):
        seated_prefill(runner, sequence, length)
    (batch,) = runner.pools.values()
    assert isinstance(batch, KVPool) and batch.capacity == 2
    assert sum(layer.nbytes for layer in batch.layers) == kv  # the same buffers, held once
    stand_ins = [list(s.cache) for s in rows]
    rises, kept = decode_rises(runner, rows, 2)  # the join, then a step of rows already decoding
    assert rises[0] <= rises[1] + kv / (4 * LAYERS), (rises, kv)
    assert kept[0] < kv / (4 * LAYERS)
    assert all(a is b for s, before in zip(rows, stand_ins) for a, b in zip(s.cache, before))


def test_a_budget_for_n_requests_runs_n_at_once_in_their_rows(llama):
    """A budget of three requests' KV (their caches' whole blocks at the end) plus one block
    each: the three, sent together, are seated, decode in the same steps, none is preempted, the
    bytes held never pass the budget, and the batch has exactly three rows (doubling to four
    would not fit: 12 blocks in 11). Each reply equals ``generate`` alone."""
    model, tokenizer = llama
    prompts = [ids(470 + 10 * i, i) for i in range(3)]  # + 40 tokens: 510, 520, 530 (2, 3, 3 blocks)
    max_tokens = 40
    sizer = Engine(model, tokenizer).sizer
    budget = sum(sizer.bytes_for(len(p) + max_tokens) + sizer.bytes_for(BLOCK) for p in prompts)
    expected = [generate(model, tokenizer, p, max_tokens, prefill_step_size=128) for p in prompts]
    engine = Engine(model, tokenizer, prefill_chunk=128, max_kv_memory=budget)
    decoding, held, seated, capacity = [], [], [], []
    real_run = engine._run

    def run(step):
        decoding.append(len(step.decode))
        real_run(step)
        active = engine.scheduler.prefilling + engine.scheduler.running
        held.append(sum(nbytes(s) for s in active) + engine.prefix_cache.nbytes)
        seated.append(all(isinstance(c, RowCache) for s in active for c in s.cache))  # from admission on
        capacity.extend(b.capacity if isinstance(b, KVPool) else 0 for b in engine.runner.pools.values())

    engine._run = run
    with engine:
        handles = [engine.submit(GenerationRequest(p, max_tokens)) for p in prompts]
        replies = ["".join(e.text for e in h) for h in handles]
    assert replies == expected
    assert max(decoding) == 3
    assert engine.metrics.registry.get_sample_value("mlxformer_preemptions_total") == 0
    assert max(held) <= budget
    assert all(seated) and min(capacity) > 0 and max(capacity) == 3


@pytest.mark.parametrize("settings", SETTINGS, ids=["float", "kv8"])
def test_staggered_requests_under_a_budget_equal_each_alone(llama, settings):
    """``test_zero_copy_join``'s five staggered prompts in three rows, under a budget of seven
    blocks: rows added at each seat and removed at each leave (one layer at a time), chunks
    widening the rows first; greedy tokens equal ``stream_generate`` alone, no step rerun."""
    model, tokenizer = llama
    budget = 7 * Engine(model, tokenizer, cache_settings=settings).sizer.bytes_for(BLOCK)
    got = staggered(model, tokenizer, settings, PROMPTS, TOKENS, max_batch=3, max_kv_memory=budget)
    assert got == [alone(model, tokenizer, settings, p, n) for p, n in zip(PROMPTS, TOKENS)]


@pytest.mark.parametrize("family, window", [("mistral", 20), ("gemma4", 7)])
def test_staggered_sliding_requests_under_a_budget_equal_each_alone(family, window, tmp_path):
    """Sliding-window rows under a budget of three rows of the longest request (each its ring
    row, ``KVSizer.peak``): every request is seated at admission (Mistral's ring rows; Gemma 4's
    ring and growing rows and its KV-shared layers), rows added at each seat and removed at
    each leave; greedy tokens equal ``stream_generate`` alone, no step rerun."""
    model, tokenizer = sliding_model(tmp_path, family, window, layers=4)
    budget = 3 * Engine(model, tokenizer, prefill_chunk=CHUNK).sizer.peak(max(len(p) + n for p, n in zip(PROMPTS, TOKENS)))
    got = staggered(model, tokenizer, None, PROMPTS, TOKENS, max_batch=3, max_kv_memory=budget)
    assert got == [alone(model, tokenizer, None, p, n) for p, n in zip(PROMPTS, TOKENS)]


@pytest.mark.parametrize("budget", [False, True], ids=["unbudgeted", "budget"])
def test_staggered_ring_rows_crossing_quantized_kv_start_equal_each_alone(llama, budget):
    """A ``max_kv_size`` of 24 turning 8-bit at 36 tokens: the rows, seated at admission (before:
    joined at their first decode step, copied in), cross in the batch while decoding or at a
    prompt chunk, each window re-encoded into a row of the quantized ring batch
    (``BatchRunner._cross``; before, the window stayed float and was seated again at every step:
    other tokens, and under a budget no end). Greedy tokens equal ``stream_generate`` alone."""
    model, tokenizer = llama
    settings = CacheSettings(max_kv_size=24, keep=2, kv_bits=8, kv_group_size=32, quantized_kv_start=36)
    limit = 3 * Engine(model, tokenizer, cache_settings=settings, prefill_chunk=CHUNK).sizer.peak(280) if budget else None
    got = staggered(model, tokenizer, settings, PROMPTS, TOKENS, max_batch=3, max_kv_memory=limit)
    assert got == [alone(model, tokenizer, settings, p, n) for p, n in zip(PROMPTS, TOKENS)]


@pytest.mark.parametrize("family", ["rotating", "gemma3", "mla"])
def test_a_rotating_join_under_a_budget_copies_nothing(family, llama, tmp_path):
    """``test_zero_copy_join``'s rotating join, staged: ring rows seated at admission (a row
    added per seat, the rows widened before each chunk) join the decode steps with MLX's peak
    rising as a steady step's; the old join (own caches copied into rows) measured beside it.
    ``mla``: an MLA model's ``max_kv_size`` window (before: not seated, copied at the join)."""
    model, settings = rotating_model(family, llama, tmp_path)
    _, batch = assert_join_copies_nothing(model, settings, staged=True)
    assert batch.staged and batch.capacity == 2


@pytest.mark.parametrize("family", ["mistral", "gemma3", "mla"])
def test_the_budget_counts_a_seated_ring_row_as_its_buffers_hold(family, tmp_path):
    """A sequence seated in its row under a budget, prefilled 100 and 300 tokens in chunks of
    32: the planner's count of a row (``KVSizer``, ``row``) equals the bytes the batch's buffers
    hold (a ring layer keeps its window of 24 and a chunk less one beyond it; Gemma 3's global
    layers grow; an MLA model's ``max_kv_size`` of 24, its latents' rings: before, not seated,
    counted at its own caches' window), more than the sequence's own caches would hold."""
    if family == "mla":
        model, settings = tiny_model(tmp_path, "deepseek_v2", **MLA)[0], CacheSettings(max_kv_size=24)
    else:
        model, settings = sliding_model(tmp_path, family, 24, LAYERS)[0], CacheSettings()
    for length in (100, 300):
        runner = BatchRunner(model)
        runner.staged, runner.prefill_chunk = True, 32
        sizer = KVSizer(model, settings, row_key=runner.row_key)
        seated_prefill(runner, Stub(make_cache(model, settings), 5), length)
        (batch,) = runner.pools.values()
        held = sum(x.nbytes for layer in batch.layers for x in layer.keys + layer.values)
        assert sizer.bytes_for(length, row=True) == held > sizer.bytes_for(length), (length, held)


def test_a_lone_ring_row_is_admitted_by_what_it_holds(tmp_path):
    """Mistral (window 20, chunks of 12: a ring row holds 31 slots per layer, its own cache 20):
    a request is refused one byte under its row's peak (``KVSizer.peak``; before, counted at its
    own cache's window: admitted, and its row held more than the budget), and at that peak it
    runs, the bytes held never over the budget, its reply equal to ``generate`` alone."""
    model, tokenizer = sliding_model(tmp_path, "mistral", 20, layers=4)
    prompt, max_tokens = ids(60, 1), 10
    sizer = Engine(model, tokenizer, prefill_chunk=CHUNK).sizer
    budget = sizer.peak(len(prompt) + max_tokens)
    assert budget > 1.5 * sizer.bytes_for(len(prompt) + max_tokens)  # the own cache's size
    with Engine(model, tokenizer, prefill_chunk=CHUNK, max_kv_memory=budget - 1) as engine:
        with pytest.raises(KVBudgetExceeded):
            engine.submit(GenerationRequest(prompt, max_tokens))
    engine = Engine(model, tokenizer, prefill_chunk=CHUNK, max_kv_memory=budget)
    held, real_run = [], engine._run

    def run(step):
        real_run(step)
        held.append(sum(nbytes(s) for s in engine.scheduler.prefilling + engine.scheduler.running))

    engine._run = run
    with engine:
        reply = "".join(e.text for e in engine.submit(GenerationRequest(prompt, max_tokens)))
    assert reply == generate(model, tokenizer, prompt, max_tokens, prefill_step_size=CHUNK)
    assert 0 < max(held) <= budget


def test_a_speculation_round_writes_and_trims_its_row_in_place(llama):
    """A speculating sequence seated beside a plain one: its round (the last token and three
    proposals) writes four slots into its row, two rejected are trimmed from it, and its next
    token runs on its row in the decode step of the other: the logits are those of its own
    caches doing the same, and its caches are the same objects throughout (nothing copied in or
    out). MLX's peak over what was held rises by one layer of the batch at most, never by the
    row's KV (four layers here): the round by 0.1-0.5 layers (measured; the row's slots read by
    attention), the step beside the batch's rows by 0.08 (its token a segment of the packed
    step, written before the rows attend: the buffers are written in place; 1.08 when the
    segments attended as they wrote, and MLX copied each layer). A round beside the batch's
    rows: ``test_speculating_rows.py``."""
    model, _ = llama
    runner, plain, speculating = plain_and_speculating(model)
    for sequence, length in ((plain, 300), (speculating, 310)):
        seated_prefill(runner, sequence, length)
    own = make_cache(model)
    BatchRunner(model).prefill(ids(310, 3), own, want_logits=False)
    (batch,) = runner.pools.values()
    kv = sum(layer.nbytes for layer in batch.layers)
    stand_ins = list(speculating.cache)
    mx.eval([layer.state for layer in batch.layers])
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    logits = runner.verify(6, mx.array([7, 8, 9]), speculating.cache)
    mx.eval(logits, [layer.state for layer in batch.layers])
    round_rise = mx.get_peak_memory() - before
    reference = model(mx.array([[6, 7, 8, 9]]), own)[0]
    assert mx.allclose(logits, reference, atol=1e-4).item()
    rewind(speculating.cache, 2)  # the last two proposals rejected
    rewind(own, 2)
    assert [c.offset for c in speculating.cache] == [312] * LAYERS and batch.layout.rows[1].used == 312
    speculating.last = 11
    logits = runner.decode([plain, speculating])
    assert mx.allclose(logits[1:], model.last_logits(mx.array([[11]]), own), atol=1e-4).item()
    assert [r.offset for r in batch.layout.rows] == [301, 313]
    rises, _ = decode_rises(runner, [plain, speculating], 1)
    assert round_rise < kv / LAYERS and rises[0] < 0.5 * kv / LAYERS, (round_rise, rises, kv)
    assert all(a is b for a, b in zip(speculating.cache, stand_ins))


@pytest.mark.parametrize("budget", [False, True], ids=["unbudgeted", "budget"])
@pytest.mark.parametrize("kind", ["lookup", "draft"])
def test_speculating_sequences_live_in_their_rows(llama, draft, kind, budget):
    """Four staggered requests (one not speculating), three rows, prompt lookup or a draft
    model: every speculating sequence's caches are its row's from admission to its end (the
    same objects: never copied in or out), its rounds verify on them, and the greedy tokens
    equal plain ``stream_generate`` alone."""
    model, tokenizer = llama
    speculative = (SpeculativeSettings(prompt_lookup=True, num_draft_tokens=4, ngram_min=1) if kind == "lookup"
                   else SpeculativeSettings(draft_model=draft[0], draft_tokenizer=draft[1], num_draft_tokens=3))
    prompts, tokens = [ids(40, 1), ids(270, 2), ids(9, 3), ids(70, 4)], [30, 12, 20, 16]
    requests = [GenerationRequest(p, max_tokens=n) for p, n in zip(prompts, tokens)]
    requests[2].speculate = False
    sizer = Engine(model, tokenizer).sizer
    limit = sum(sizer.bytes_for(len(p) + n + 4) + sizer.bytes_for(BLOCK) for p, n in zip(prompts, tokens))
    engine = Engine(model, tokenizer, max_batch=3, prefill_chunk=CHUNK, step_tokens=2 * CHUNK,
                    speculative=speculative, max_kv_memory=limit if budget else None)
    caches: dict[int, set[tuple[int, ...]]] = {}  # id(sequence) -> its caches' ids at each step
    seated: list[bool] = []
    real_run, rounds = engine._run, watch_rounds(engine.runner, (RowCache,))

    def run(step):
        real_run(step)
        for sequence in engine.scheduler.prefilling + engine.scheduler.running:
            if sequence.speculator is not None and sequence.cache:
                seated.append(all(isinstance(c, RowCache) for c in sequence.cache))
                caches.setdefault(id(sequence), set()).add(tuple(map(id, sequence.cache)))

    engine._run = run  # type: ignore[method-assign]
    got = in_turn(engine, requests)
    assert got == [alone(model, tokenizer, None, p, n) for p, n in zip(prompts, tokens)]
    assert all(seated) and len(caches) == 3 and all(len(seen) == 1 for seen in caches.values())
    assert rounds and all(rounds)
