"""Host syncs, counted by a hook on every way MLX hands values to Python (``mx.eval``,
``array.item``, ``array.tolist``): one per speculative round (greedy and sampled, prompt lookup),
one per single-stream decode step, and one for a whole batch's choices; prompt lookup's n-gram
index answers what a rescan of the history answers."""

from __future__ import annotations

import contextlib
import random

import mlx.core as mx
import pytest

from mlxformer import stream_generate
from mlxformer.decoding import open_sequence
from mlxformer.options import SamplingSettings
from mlxformer.speculative import PromptLookupProposer, SpeculativeSettings
from mlxformer.steps import prefill


@contextlib.contextmanager
def counting_syncs(monkeypatch):
    """A list that gets one entry per host sync inside the block."""
    syncs: list[str] = []
    for name in ("item", "tolist"):
        real = getattr(mx.array, name)
        monkeypatch.setattr(mx.array, name, lambda self, *a, _real=real, _name=name: (syncs.append(_name), _real(self, *a))[1])
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a, **k: (syncs.append("eval"), real_eval(*a, **k))[1])
    try:
        yield syncs
    finally:
        monkeypatch.undo()


REPEATING = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"


@pytest.mark.parametrize("sampling", [SamplingSettings(), SamplingSettings(temp=0.8, top_p=0.9, seed=3,
                                                                           repetition_penalty=1.1)])
def test_one_sync_per_speculative_round(tiny_byte_llama, sampling, monkeypatch):
    model, tokenizer = tiny_byte_llama
    state = open_sequence(model, tokenizer.encode(REPEATING), eos_ids=[], detokenizer=None, sampling=sampling,
                          max_tokens=60, speculative=SpeculativeSettings(num_draft_tokens=4, prompt_lookup=True,
                                                                         ngram_min=1))
    logits = prefill(model, mx.array(state.tokens), state.cache)
    state.record(int(state.choose(logits)[0].item()))
    rounds = 0
    while state.room > 5 and rounds < 6:
        state.settle()
        with counting_syncs(monkeypatch) as syncs:
            proposed = state.propose()
            if not proposed:  # a plain step
                state.record(int(state.choose(model.last_logits(mx.array([[state.last_token]]), state.cache))[0].item()))
                continue
            target = model(mx.array([[state.last_token, *proposed]]), state.cache)[0]  # (k + 1, vocab)
            tokens, logprobs = state.verify(target)
        assert syncs == ["tolist"], syncs  # before: one item() per draft and per verified token
        assert 1 <= len(tokens) <= len(proposed) + 1 and logprobs.shape == (len(tokens), model.args.vocab_size)
        for token in tokens:
            state.record(token)
        rounds += 1
    assert rounds >= 2  # the repeating prompt gave proposals


def test_one_sync_per_single_stream_step(tiny_byte_llama, monkeypatch):
    model, tokenizer = tiny_byte_llama
    plain = [r.token for r in stream_generate(model, tokenizer, "hello world", 12)]
    with counting_syncs(monkeypatch) as syncs:
        got = [r.token for r in stream_generate(model, tokenizer, "hello world", 12)]
    assert got == plain and syncs == ["item"] * 12, syncs


def test_speculative_greedy_equals_plain_decoding(tiny_byte_llama):
    model, tokenizer = tiny_byte_llama
    prompt = tokenizer.encode(REPEATING)
    plain = [r.token for r in stream_generate(model, tokenizer, prompt, 30)]
    settings = SpeculativeSettings(num_draft_tokens=4, prompt_lookup=True, ngram_min=1)
    fast = list(stream_generate(model, tokenizer, prompt, 30, speculative=settings))
    assert [r.token for r in fast] == plain and fast[-1].proposed_tokens > 0


def rescan(history: list[int], k: int, ngram_max: int, ngram_min: int) -> list[int]:
    """Prompt lookup as a scan of the whole history (the old algorithm): the reference."""
    for n in range(min(ngram_max, len(history) - 1), ngram_min - 1, -1):
        tail = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == tail:
                return history[start + n:start + n + k]
    return []


def test_prompt_lookup_index_equals_a_rescan():
    rng = random.Random(0)
    lookup = PromptLookupProposer(ngram_max=3, ngram_min=1)
    history = [rng.randrange(6) for _ in range(5)]
    for step in range(300):
        if step == 150:  # another conversation: the index starts over
            history = [rng.randrange(6) for _ in range(3)]
        assert lookup.propose(history, 4)[0] == rescan(history, 4, 3, 1), step
        history = history + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
