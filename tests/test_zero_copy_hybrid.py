"""KV in one place for hybrid models (issue 32): a Qwen3.5 / Qwen3-Next sequence's recurrent
states live in its row of the decode batch's stacked state buffers from admission on
(``cache/state_rows.py``), beside its attention layers' keys/values (``cache/pool.py``), so
joining the decode steps copies nothing; with a ``max_kv_size`` window too (its attention rows
are rings, the recurrent rows follow their layout). Checked with MLX's peak memory (the old
join measured beside it), by staggered requests' greedy replies against ``stream_generate``
alone (also with rows crossing ``quantized_kv_start``), and by a prefix-cache hit on snapshots
cut from a row against a cold engine."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from conftest import write_byte_tokenizer, write_tiny_checkpoint
from mlxformer import load, stream_generate
from mlxformer.cache import CacheSettings, make_cache
from mlxformer.cache.pool import KVPool
from mlxformer.cache.state_rows import StateRowCache, StateRows
from mlxformer.engine import Engine, GenerationRequest
from mlxformer.engine.batch_runner import BatchRunner
from mlxformer.engine.memory import KVSizer
from test_rows_budget import seated_prefill
from test_zero_copy_join import CHUNK, HYBRID, Stub, alone, assert_join_copies_nothing, ids, riding_rises, staggered

EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)
FAMILIES = {"qwen3_5_text": {}, "qwen3_next": EXPERTS}
# the attention layers' rows growing, or rings of a window smaller than the prompts (before:
# a hybrid's ring rows were prefilled apart and copied into the batch at the join)
SETTINGS = {"growing": None, "ring": CacheSettings(max_kv_size=24, keep=2)}


def tiny(directory, family: str, **config):
    directory, _ = write_tiny_checkpoint(directory, family, **{**HYBRID, **FAMILIES[family], **config})
    write_byte_tokenizer(directory)
    model, tokenizer = load(directory, dtype=mx.float32)
    tokenizer.eos_token_ids = []
    return model, tokenizer


@pytest.fixture(scope="module", params=list(FAMILIES))
def hybrid(request, tmp_path_factory):
    return tiny(tmp_path_factory.mktemp(request.param), request.param)


def record_seats(monkeypatch) -> list[int]:
    """The tokens each ``KVPool.seat`` writes into its row (0: an empty row at admission;
    more: a prefix-cache hit)."""
    written: list[int] = []
    seat = KVPool.seat

    def seating(self, caches):
        written.append(int(caches[0].offset))
        return seat(self, caches)

    monkeypatch.setattr(KVPool, "seat", seating)
    return written


@pytest.mark.parametrize("window", [None, 96], ids=["growing", "ring"])
@pytest.mark.parametrize("staged", [False, True], ids=["unbudgeted", "budget"])
def test_a_hybrid_join_copies_nothing(staged, window, tmp_path):
    """Two Qwen3.5 sequences (4 DeltaNet, 4 attention layers) prefill in their rows: their first
    decode step raises MLX's peak memory as a steady step does. ``budget``: staged (a row added per seat, its states too). ``ring``:
    a ``max_kv_size`` of 96 (prompts of 300 and 310 in chunks of 128: the rings turn)."""
    layer_types = ["linear_attention", "full_attention"] * 4
    model, _ = tiny(tmp_path, "qwen3_5_text", num_hidden_layers=8, layer_types=layer_types)
    settings = None if window is None else CacheSettings(max_kv_size=window, keep=2)
    _, batch = assert_join_copies_nothing(model, settings, staged=staged)
    assert batch.staged == staged
    (layout,) = batch.layouts.values()
    assert [r.offset for r in layout.rows] == [302, 312]
    assert layout.kind.rotating == (window is not None)
    if window is not None:  # every row's ring has turned
        assert all(r.used == layout.kind.capacity < 300 for r in layout.rows)


@pytest.mark.parametrize("ring", [False, True], ids=["growing", "ring"])
@pytest.mark.parametrize("speculates", [False, True], ids=["plain", "speculating"])
def test_the_budget_counts_a_seated_hybrid_row_as_its_buffers_hold(speculates, ring, tmp_path):
    """A Qwen3.5 sequence seated under a budget, prefilled 100 tokens: the planner's count of a
    row (``KVSizer``, ``row``) equals the bytes the batch's buffers hold (its keys/values and its
    recurrent layers' window and state, no past states), less than its own caches (which keep
    a state to take back). A speculating row (3 draft tokens) after a round also holds its
    recurrent layers' last states beside the row (``StateRowCache._past``): counted too.
    ``ring``: a ``max_kv_size`` of 24, its ring rows 23 slots beyond the own caches' (chunks of
    32 past a window of 24: a window's less one; before, counted as the own caches' slots)."""
    model, _ = tiny(tmp_path, "qwen3_5_text")
    settings = CacheSettings(rewind=3 if speculates else 0, max_kv_size=24 if ring else None, keep=2 if ring else 4)
    runner = BatchRunner(model)
    runner.staged, runner.prefill_chunk = True, 32
    sizer = KVSizer(model, settings, row_key=runner.row_key)
    sequence = Stub(make_cache(model, settings), 5)
    sequence.speculator = object() if speculates else None
    seated_prefill(runner, sequence, 100)
    if speculates:  # a round of the last token and 3 proposals: the row keeps their states
        sequence.cache[0].pool.reserve(104)
        mx.eval(runner.verify(5, mx.array([6, 7, 8]), sequence.cache))
    (batch,) = runner.pools.values()
    assert any(isinstance(layer, StateRows) for layer in batch.layers)
    past = [c._past for c in sequence.cache if isinstance(c, StateRowCache)]
    held = sum(layer.nbytes for layer in batch.layers) + sum(p.nbytes for p in past if p is not None)
    assert all(p is not None for p in past) == speculates
    assert sizer.bytes_for(104 if speculates else 100, row=True) == held
    assert held < sizer.bytes_for(100) or speculates or ring
    if ring:  # the ring layers' slots: the window (and a speculating row's slack) and 23
        assert {layer.keys[0].shape[2] for layer in batch.layers if not isinstance(layer, StateRows)} == {
            24 + settings.rewind + 23}


@pytest.mark.parametrize("settings", list(SETTINGS))
def test_staggered_hybrid_requests_equal_each_alone(hybrid, settings, monkeypatch):
    """Four prompts, two rows: each prefills in its row (seated empty at admission: no join
    copies a prefilled row in) while the other decodes; greedy replies equal ``stream_generate``
    alone, no step rerun row by row. ``ring``: the attention rows' rings turn."""
    model, tokenizer = hybrid
    settings = SETTINGS[settings]
    written = record_seats(monkeypatch)
    prompts = [ids(30, 1), ids(21, 2), ids(9, 3), ids(40, 4)]
    got = staggered(model, tokenizer, settings, prompts, [8] * 4, max_batch=2)
    assert got == [alone(model, tokenizer, settings, p, 8) for p in prompts]
    assert written == [0] * 4  # before: [30, 21, 9, 40], each prefilled sequence copied in at its first decode step


@pytest.mark.parametrize("settings", list(SETTINGS))
def test_staggered_hybrid_requests_under_a_kv_budget_equal_each_alone(hybrid, settings, monkeypatch):
    """Under a budget of two rows of the longest request (``KVSizer.peak``) a hybrid's sequences
    are seated at admission (before: joined at their first decode step, the staged leave
    rewrote attention rows only), a row added at each seat and removed at each leave with its
    states: greedy replies equal each alone. ``ring``: ring rows (their slots beyond the window
    counted)."""
    model, tokenizer = hybrid
    settings = SETTINGS[settings]
    written = record_seats(monkeypatch)
    prompts = [ids(30, 1), ids(21, 2), ids(9, 3), ids(40, 4)]
    budget = 2 * Engine(model, tokenizer, cache_settings=settings, prefill_chunk=CHUNK).sizer.peak(48)
    got = staggered(model, tokenizer, settings, prompts, [8] * 4, max_batch=2, max_kv_memory=budget)
    assert got == [alone(model, tokenizer, settings, p, 8) for p in prompts]
    assert written == [0] * 4


def test_hybrid_rows_cross_quantized_kv_start(tmp_path, monkeypatch):
    """8-bit keys/values from 25 tokens: two rows cross while decoding, one at a prompt chunk;
    each is re-encoded into a row of the quantized batch with its states beside (rows of 30, 25
    and 36 tokens seated there), and every reply equals its own alone."""
    model, tokenizer = tiny(tmp_path, "qwen3_5_text")
    settings = CacheSettings(kv_bits=8, kv_group_size=32, quantized_kv_start=25)
    written = record_seats(monkeypatch)
    prompts = [ids(30, 1), ids(21, 2), ids(9, 3), ids(40, 4)]
    got = staggered(model, tokenizer, settings, prompts, [8] * 4, max_batch=2)
    assert got == [alone(model, tokenizer, settings, p, 8) for p in prompts]
    assert sorted(written) == [0] * 4 + [25, 30, 36]


@pytest.mark.parametrize("window", [None, 48], ids=["growing", "ring"])
def test_a_prefix_hit_on_a_seated_hybrid_row_equals_cold(window, monkeypatch, tmp_path):
    """A 100-token prompt prefills in its row (chunks of 32: a state snapshot cut from the row
    after each) and decodes; while it does, a prompt sharing its first 80 tokens resumes from the
    snapshot at 64, written into a row of the same batch. Its tokens and log-probabilities equal
    a cold engine's bit for bit (its tokens ``stream_generate``'s alone), and the first's reply is
    its own alone. ``ring``: a ``max_kv_size`` of 48 without sinks (a sliding window: the hit's
    window placed in the ring's slots, ``placement``)."""
    model, tokenizer = tiny(tmp_path, "qwen3_5_text")
    settings = None if window is None else CacheSettings(max_kv_size=window, keep=0)
    rng = np.random.default_rng(1)
    first = [int(t) for t in rng.integers(3, 256, size=100)]
    second = first[:80] + [int(t) for t in rng.integers(3, 256, size=30)]

    def run(engine, prompt, n):
        return engine.submit(GenerationRequest(prompt, n, logprobs=0))

    def read(handle):
        events = [e for e in handle if e.token is not None]
        return [e.token for e in events], [e.logprob for e in events], events[-1].cached_tokens

    with Engine(model, tokenizer, max_batch=2, prefill_chunk=32, prefix_cache_bytes=0, cache_settings=settings) as cold:
        expected = read(run(cold, second, 6))
    written = record_seats(monkeypatch)
    with Engine(model, tokenizer, max_batch=2, prefill_chunk=32, prefix_cache_bytes=10**8,
                cache_settings=settings) as engine:
        long = iter(run(engine, first, 30))
        head = next(long)  # its prompt is in its row; it decodes while the second prefills
        hit = read(run(engine, second, 6))
        reply = [head.token] + [e.token for e in long if e.token is not None]
    assert written == [0, 64]  # the first seated empty, the second with the snapshot's 64 tokens
    assert hit[2] == 64
    assert hit[:2] == expected[:2]  # bit for bit
    assert hit[0] == [r.token for r in stream_generate(model, tokenizer, second, 6, cache_settings=settings)]
    assert reply == [r.token for r in stream_generate(model, tokenizer, first, 30, cache_settings=settings)]


def test_a_chunk_riding_beside_decoding_rows_writes_in_place(hybrid):
    """A prompt chunk in its seated row beside a row decoding in the same hybrid batch: one
    packed forward, every segment's attention keys written before any attends and each
    recurrent segment scanning from its own row's state, so MLX writes the row in place. MLX's
    peak over what was held, in attention layers of the batch: 0.16-0.21 (a decode step alone:
    0.06); before, the chunk's write copied each attention layer (1.11)."""
    alone, riding = riding_rises(hybrid[0], CacheSettings())
    assert riding < alone + 0.5, (alone, riding)
