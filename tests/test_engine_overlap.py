"""The engine's overlap (issue 32): a decode step is queued before the last step's tokens are
read, so a request that one read ends has already been fed its last token. Its text is what
``stream_generate`` gives alone (stop strings, ``max_tokens``), and the prefix cache keeps
exactly its prompt and output but the last token (the keys/values of a fresh prefill of them),
also when its client cancels."""

from __future__ import annotations

import mlx.core as mx

from mlxformer import stream_generate
from mlxformer.cache import make_cache
from mlxformer.engine import Engine, GenerationRequest
from mlxformer.engine.prompt_cache import PromptCacheSettings
from mlxformer.sampling.options import SamplingSettings

PROMPTS = ["hello world", "once upon a time", "good morning", "lorem ipsum"]


def assert_kept(engine: Engine, model, tokens: list[int]) -> None:
    """The prefix cache holds ``tokens[:-1]`` (one-token blocks), as a fresh prefill computes them."""
    key, cache = tokens[:-1], engine.prefix_cache
    assert cache.cached_blocks(cache.keys_for(tokens)) == len(key)
    hit, n = cache.lookup(tokens)
    assert n == len(key)
    fresh = make_cache(model)
    mx.eval(model.hidden_states(mx.array([key]), fresh))
    for kept, reference in zip(hit, fresh):
        assert kept.offset == len(key)
        for a, b in zip(kept.keys + kept.values, reference.state):
            assert a.shape == b.shape and mx.allclose(a, b, atol=1e-4).item()


def test_finished_and_cancelled_rows_keep_exactly_their_tokens_but_the_last(tiny_byte_llama, monkeypatch):
    model, tokenizer = tiny_byte_llama
    monkeypatch.setattr(tokenizer, "eos_token_ids", [])
    sampling = SamplingSettings(temp=0.8, seed=11, repetition_penalty=1.2)
    ids = [tokenizer.encode(p) for p in PROMPTS]
    plain = [[r.token for r in stream_generate(model, tokenizer, p, 24, sampling=sampling)] for p in ids]
    stop_at = next(i for i in range(5, 20) if plain[0][i] not in plain[0][:i])  # a byte seen once: a stop string
    stop = [tokenizer.decode([plain[0][stop_at]])]
    requests = [GenerationRequest(ids[0], 24, sampling, stop=stop),  # ends by its stop string
                GenerationRequest(ids[1], 7, sampling),  # by max_tokens
                GenerationRequest(ids[2], 24, sampling),
                GenerationRequest(ids[3], 200, sampling)]  # cancelled by its client
    expected = [[r.token for r in stream_generate(model, tokenizer, r.prompt_ids, r.max_tokens, sampling=sampling,
                                                  stop=r.stop)] for r in requests[:3]]
    texts = ["".join(r.text for r in stream_generate(model, tokenizer, r.prompt_ids, r.max_tokens, sampling=sampling,
                                                     stop=r.stop)) for r in requests[:3]]
    queued = []
    with Engine(model, tokenizer, max_batch=4, prompt_cache=PromptCacheSettings(block_size=1)) as engine:
        real_hand_out = engine.delivery.hand_out
        engine.delivery.hand_out = lambda q, now: (queued.append(bool(q)), real_hand_out(q, now))[1]  # type: ignore[method-assign]
        handles = [engine.submit(r) for r in requests]
        events = [list(h) for h in handles[:3]]
        for n, _ in enumerate(handles[3]):
            if n == 9:
                handles[3].cancel()
        assert [[e.token for e in ev] for ev in events] == expected
        assert ["".join(e.text for e in ev) for ev in events] == texts
        assert [ev[-1].finish_reason for ev in events] == ["stop", "length", "length"]
        assert len(expected[0]) == stop_at + 1 and sum(queued) >= 10  # the steps were overlapped
        cancelled = handles[3].sequence
        assert cancelled.finish_reason == "cancelled" and len(cancelled.generated) < 200
        for request, ev in zip(requests[:3], events):
            assert_kept(engine, model, request.prompt_ids + [e.token for e in ev])
        assert_kept(engine, model, cancelled.tokens)
