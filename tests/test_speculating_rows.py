"""Speculating sequences with sliding-window or recurrent layers live in their rows (issue 32,
"KV in one place"): seated at admission, their rounds verify on their rows, and a rejected round
is taken back there (a turned ring's index steps back over the rejected slots,
``RowPlace._move_back``; a recurrent row keeps its last tokens' states, as its own cache does,
and writes back the state before the rejected tokens, ``StateRowCache.trim``; a hybrid's ring
rows beside recurrent rows, both moved back by ``RowPlace._move_back``). Checked by the greedy
replies against plain ``stream_generate`` alone (speculation must not change a token)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from conftest import tiny_byte_llama_of
from mlxformer.cache import CacheSettings, make_cache
from mlxformer.cache.pool import RingRowCache, RowCache
from mlxformer.cache.state_rows import StateRowCache, StateRows
from mlxformer.engine import Engine, GenerationRequest
from mlxformer.engine.batch_runner import BatchRunner, speculation_round
from mlxformer.speculative.speculator import SpeculativeSettings
from test_zero_copy_hybrid import tiny
from test_zero_copy_join import (CHUNK, LAYERS, alone, ids, in_turn, plain_and_speculating, sliding_model, Stub,
                                 watch_rounds)

WINDOW = 20  # Mistral's: a row holds 20 + 4 (the rounds' slack) + 11 (a chunk of 12 less one) slots


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """A one-layer Llama draft with the same byte tokenizer (its proposals mostly rejected)."""
    return tiny_byte_llama_of(tmp_path_factory.mktemp("speculating_rows_draft"), 1)


@pytest.fixture(scope="module", params=["mistral", "gemma3", "qwen3_5_text", "qwen3_5_ring"])
def target(request, tmp_path_factory):
    """The model (Gemma 3: sliding and global layers, a row in each of two slot layouts), the
    row cache whose trims the test watches (a ring's, a recurrent row's) and the cache settings
    (``qwen3_5_ring``: a ``max_kv_size`` of ``WINDOW``, ring rows beside recurrent rows)."""
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3_5_text":
        return tiny(directory, "qwen3_5_text"), StateRowCache, None
    if request.param == "qwen3_5_ring":
        # a recurrent layer last: the row moves back when it is trimmed (``RowPlace._move_back``)
        layer_types = ["full_attention", "linear_attention"] * 2
        return (tiny(directory, "qwen3_5_text", layer_types=layer_types), RingRowCache,
                CacheSettings(max_kv_size=WINDOW, keep=2))
    return sliding_model(directory, request.param, WINDOW, layers=4), RingRowCache, None


@pytest.mark.parametrize("kind", ["lookup", "draft", "lookup_budget"])
def test_speculating_rows_take_back_rejected_rounds(target, draft, kind, monkeypatch):
    """Four staggered requests (one not speculating) in three rows: every sequence is seated at
    admission, every round verifies on its row, rounds are rejected and taken back in the rows
    (a ring that had turned: prompts longer than its slots), each speculating sequence keeps the
    same cache objects to its end, and the greedy replies equal ``stream_generate`` alone (also
    a hybrid prompt resuming from the prefix cache's snapshot of a speculating row).
    ``lookup_budget``: under a KV budget of three rows of the longest request (a row added per
    seat, removed per leave; a speculating recurrent row's kept states counted)."""
    (model, tokenizer), watched, settings = target
    speculative = (SpeculativeSettings(prompt_lookup=True, num_draft_tokens=4, ngram_min=1) if "lookup" in kind
                   else SpeculativeSettings(draft_model=draft[0], draft_tokenizer=draft[1], num_draft_tokens=4))
    prompts, tokens = [ids(40, 1), ids(70, 2), ids(9, 3), ids(50, 4)], [24, 16, 12, 16]
    requests = [GenerationRequest(p, max_tokens=n) for p, n in zip(prompts, tokens)]
    requests[2].speculate = False
    options = dict(max_batch=3, prefill_chunk=CHUNK, step_tokens=2 * CHUNK, speculative=speculative,
                   cache_settings=settings)
    if kind == "lookup_budget":
        options["max_kv_memory"] = 3 * Engine(model, tokenizer, **options).sizer.peak(86 + 4)
    engine = Engine(model, tokenizer, **options)
    assert engine.runner.staged == (kind == "lookup_budget")
    taken: list[tuple[bool, int]] = []  # each watched trim: (the ring had turned / a recurrent row, tokens back)
    trim = watched.trim

    def watched_trim(self, n: int) -> int:
        turned = not isinstance(self, RingRowCache) or self.row.used == self._kind.capacity
        taken.append((turned, trim(self, n)))
        return taken[-1][1]

    monkeypatch.setattr(watched, "trim", watched_trim)
    speculating, caches = {}, {}
    real_run, rounds = engine._run, watch_rounds(engine.runner, (RowCache, StateRowCache))

    def run(step):
        real_run(step)
        for sequence in engine.scheduler.prefilling + engine.scheduler.running:
            if sequence.speculator is not None:
                speculating[id(sequence)] = sequence
                caches.setdefault(id(sequence), set()).add(tuple(map(id, sequence.cache)))

    engine._run = run  # type: ignore[method-assign]
    got = in_turn(engine, requests, seats=True)
    assert got == [alone(model, tokenizer, settings, p, n) for p, n in zip(prompts, tokens)]
    assert rounds and all(rounds)
    assert len(speculating) == 3 and all(len(seen) == 1 for seen in caches.values())
    stats = [s.speculator.stats for s in speculating.values()]
    assert sum(s.proposed - s.accepted for s in stats) > 0  # rejections happened
    assert any(turned and n > 0 for turned, n in taken)  # and were taken back in a row past its first turn
    if watched is StateRowCache:  # a prompt continuing the first reply resumes from the state cut
        hits = engine.metrics.prefix_hit_tokens._value.get()  # from its row at retire
        again = prompts[0] + got[0] + ids(5, 6)
        assert in_turn(engine, [GenerationRequest(again, max_tokens=8)]) == [alone(model, tokenizer, None, again, 8)]
        assert engine.metrics.prefix_hit_tokens._value.get() - hits == len(prompts[0]) + len(got[0]) - 1


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_byte_llama_of(tmp_path_factory.mktemp("speculating_rows_llama"), LAYERS)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return tiny(tmp_path_factory.mktemp("speculating_rows_hybrid"), "qwen3_5_text")


@pytest.mark.parametrize("rows", ["float", "ring", "hybrid"])
@pytest.mark.parametrize("kind", ["lookup", "draft"])
def test_a_round_beside_decoding_rows_writes_in_place(llama, hybrid, draft, kind, rows, monkeypatch):
    """A seated speculating sequence's round (its last token and four proposals, by prompt
    lookup or a draft model) in a step where a row of its batch decodes (600 tokens): the round
    is a segment of the packed step (``speculation_round``), written before the batch's rows
    attend, so MLX writes each layer's buffer in place (a hybrid's recurrent segments too,
    each scanning from its own state).
    MLX's peak over what was held once the proposals were made, in attention layers of the
    batch, stays well under one (measured: 0.08-0.15 for ``float`` and ``ring``, a window of
    512; ``hybrid`` 0.06-0.10, up to 0.46 at its first round, which also frees what
    the prompt's last steps left); before, the round was a forward of its own after the
    batch's, whose attention still read the buffer the round's write replaced, and MLX copied
    each attention layer at every round (1.05-1.12). Greedy replies equal ``stream_generate``
    alone."""
    model, tokenizer = hybrid if rows == "hybrid" else llama
    settings = CacheSettings(max_kv_size=512, keep=2) if rows == "ring" else None
    speculative = (SpeculativeSettings(prompt_lookup=True, num_draft_tokens=4, ngram_min=1) if kind == "lookup"
                   else SpeculativeSettings(draft_model=draft[0], draft_tokenizer=draft[1], num_draft_tokens=4))
    prompts, tokens = [ids(600, 1), ids(300, 2)], [48, 16]
    requests = [GenerationRequest(p, max_tokens=n) for p, n in zip(prompts, tokens)]
    requests[0].speculate = False
    engine = Engine(model, tokenizer, max_batch=2, prefill_chunk=128, speculative=speculative, prefix_cache_bytes=0,
                    cache_settings=settings)
    rises: list[float] = []  # each step with a round beside a decoding row: MLX's peak over what was held
    real_run, real_propose = engine._run, engine.decoding.propose
    measured: list[tuple[bool, int]] = []  # the step's: whether a round rides beside a decoding row, bytes held

    def propose(running):  # what was held once the proposals are made (a draft's first prefills its cache)
        decode, verifying = real_propose(running)
        mx.eval([x.state for batch in engine.runner.pools.values() for x in batch.layers], [p for _, p in verifying])
        mx.synchronize()
        measured.append((bool(decode and verifying), mx.get_active_memory()))
        mx.reset_peak_memory()
        return decode, verifying

    def run(step):
        real_run(step)
        layers = [x for batch in engine.runner.pools.values() for x in batch.layers]
        mx.eval([x.state for x in layers])
        mx.synchronize()
        if measured and measured[-1][0]:
            attention = [x.nbytes for x in layers if not isinstance(x, StateRows)]  # a hybrid's states are small
            rises.append((mx.get_peak_memory() - measured[-1][1]) / (sum(attention) / len(attention)))
        measured.clear()

    engine._run, engine.decoding.propose = run, propose  # type: ignore[method-assign]
    # the device still runs a step when the host builds what follows it (a GPU's async_eval
    # returns at once; the CPU here would often have finished the batch's step already)
    monkeypatch.setattr(mx, "async_eval", lambda *arrays: None)
    got = in_turn(engine, requests, seats=True)
    assert got == [alone(model, tokenizer, settings, p, n) for p, n in zip(prompts, tokens)]
    assert len(rises) >= 3, rises
    assert max(rises) < 0.6 and sorted(rises)[len(rises) // 2] < 0.25, rises


def test_a_round_in_a_decode_step_computes_what_it_computes_alone(llama):
    """A seated speculating row's round in the packed step of a decoding row of its batch
    (``speculation_round``): every position's logits, the tokens its row then holds, and the
    hidden rows the model's watch gets for its caches (native MTP drafts from them) are those
    of the same round on own caches in a forward of its own."""
    model, _ = llama
    runner, decoding, speculating = plain_and_speculating(model)
    for sequence, seed in ((decoding, 3), (speculating, 4)):
        runner.seat(sequence)
        runner.prefill(ids(30 + seed, seed), sequence.cache, want_logits=False)
    own = make_cache(model)
    BatchRunner(model).prefill(ids(34, 4), own, want_logits=False)
    seen: list[tuple[mx.array, list]] = []
    model.watch_hidden(lambda hidden, cache: seen.append((hidden, cache)))
    try:
        logits, (verified,) = runner.step([decoding], [speculation_round(6, mx.array([7, 8, 9]), speculating.cache)])
        hidden = model.hidden_states(mx.array([[6, 7, 8, 9]]), own)  # (1, 4, hidden)
    finally:
        model.watch_hidden(None)
    assert logits.shape[0] == 1 and verified.shape[0] == 4
    assert mx.allclose(verified, model.logits(hidden)[0], atol=1e-4).item()
    (watched,) = [h for h, cache in seen if cache is speculating.cache]
    assert watched.shape == hidden.shape and mx.allclose(watched, hidden, atol=1e-4).item()
    assert [c.offset for c in speculating.cache] == [38] * LAYERS
