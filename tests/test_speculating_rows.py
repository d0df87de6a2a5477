"""Speculating sequences with sliding-window or recurrent layers live in their rows (issue 32,
"KV in one place"): seated at admission, their rounds verify on their rows, and a rejected round
is taken back there (a turned ring's index steps back over the rejected slots,
``RingWrites._move_back``; a recurrent row keeps its last tokens' states, as its own cache does,
and writes back the state before the rejected tokens, ``StateRowCache.trim``; a hybrid's ring
rows beside recurrent rows, both moved back by ``move_ring_back``). Checked by the greedy
replies against plain ``stream_generate`` alone (speculation must not change a token)."""

from __future__ import annotations

import pytest

from conftest import tiny_byte_llama_of
from mlxformer.cache import CacheSettings
from mlxformer.cache.rows import RingRowCache, RowCache
from mlxformer.cache.state_rows import StateRowCache
from mlxformer.engine import Engine, GenerationRequest
from mlxformer.speculative import SpeculativeSettings
from test_zero_copy_hybrid import tiny
from test_zero_copy_join import CHUNK, alone, ids, in_turn, sliding_model

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
        # a recurrent layer last: the row moves back when it is trimmed (``StateRowCache._move_back``)
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
    speculating, caches, rounds = {}, {}, []
    real_run, real_verify = engine._run, engine.runner.verify

    def run(step):
        real_run(step)
        for sequence in engine.scheduler.prefilling + engine.scheduler.running:
            if sequence.speculator is not None:
                speculating[id(sequence)] = sequence
                caches.setdefault(id(sequence), set()).add(tuple(map(id, sequence.cache)))

    def verify(last, proposed, cache):
        rounds.append(all(isinstance(c, (RowCache, StateRowCache)) for c in cache))
        return real_verify(last, proposed, cache)

    engine._run, engine.runner.verify = run, verify
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
