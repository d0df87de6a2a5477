"""Speculative decoding in the batching engine: every sequence of a batch decoded with prompt
lookup or a draft model gives, greedily, the tokens plain ``stream_generate`` gives alone (float,
8-bit and rotating caches; mixed requests joining mid-way; processors; a constraint, which does
not speculate); logprobs of accepted tokens against transformers; seeded sampling reproducible
whatever runs beside it; the prefix cache keeps exactly the sequence's tokens after rewinds."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from conftest import write_tiny_checkpoint
from mlxformer import load, stream_generate
from mlxformer.cache import CacheSettings, make_cache
from mlxformer.engine import Engine, GenerationRequest, batch_generate
from mlxformer.engine.prompt_cache import PromptCacheSettings
from mlxformer.errors import MlxformerError
from mlxformer.generation.stream import SamplingSettings
from mlxformer.speculative.speculator import SpeculativeSettings
from test_engine import AllowedTokens
from test_speculative import SHAPE, write_word_tokenizer

CHUNK = 8  # prompts span several prefill chunks


def tiny_words(directory, seed: int = 0, vocab_size: int = 256, **config):
    """A tiny random Llama over a word vocabulary that never stops early, and its transformers twin."""
    _, hf_model = write_tiny_checkpoint(directory, "llama", seed=seed, vocab_size=vocab_size, **{**SHAPE, **config})
    write_word_tokenizer(directory, vocab_size)
    model, tokenizer = load(directory, threads=1, dtype=mx.float32)  # like the transformers twin, on any device
    tokenizer.eos_token_ids = []
    return model, tokenizer, hf_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target, its transformers twin, a one-layer draft with other weights)."""
    model, tokenizer, hf_model = tiny_words(tmp_path_factory.mktemp("target"))
    draft, draft_tokenizer, _ = tiny_words(tmp_path_factory.mktemp("draft"), seed=1, num_hidden_layers=1)
    return model, tokenizer, hf_model, (draft, draft_tokenizer)


# Prompts with repeats, so that prompt lookup finds n-grams to propose.
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 11, 12, 5, 6, 7, 8, 9, 13, 5, 6, 7],
    [20, 21, 22, 20, 21, 22, 20, 21],
    [3],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 40, 41, 42, 43, 44, 45, 46, 47],
    [9, 9, 9, 9],
    [100, 101, 102, 103, 100, 101],
]
MAX_TOKENS = [30, 25, 12, 28, 20, 18]

CACHES = {
    "float": None,
    "kv8": CacheSettings(kv_bits=8),
    "rotating": CacheSettings(max_kv_size=24),  # prompts plus outputs overflow it: evictions happen
}


def speculative_settings(kind: str, models) -> SpeculativeSettings:
    model, tokenizer, _, (draft, draft_tokenizer) = models
    if kind == "lookup":
        return SpeculativeSettings(prompt_lookup=True, num_draft_tokens=5, ngram_min=1)  # random models: 1-grams too
    if kind == "self-draft":  # the target drafting for itself: nearly everything is accepted
        return SpeculativeSettings(draft_model=model, draft_tokenizer=tokenizer, num_draft_tokens=3)
    return SpeculativeSettings(draft_model=draft, draft_tokenizer=draft_tokenizer, num_draft_tokens=3)


def plain_tokens(model, tokenizer, request: GenerationRequest, cache_settings=None, constraint=None) -> list[int]:
    """What plain (not speculative) ``stream_generate`` gives for ``request`` alone."""
    return [r.token for r in stream_generate(
        model, tokenizer, request.prompt_ids, request.max_tokens, sampling=request.sampling, stop=request.stop,
        cache_settings=cache_settings, prefill_step_size=CHUNK, constraint=constraint,
    )]


def collect(handle) -> tuple[list[int], list]:
    events = list(handle)
    return [e.token for e in events if e.token is not None], events


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("kind", ["lookup", "self-draft", "other-draft"])
def test_speculative_batch_matches_plain_alone(models, kind, cache):
    """Greedy requests (one with a repetition penalty, one opting out of speculation, one under a
    constraint), more requests than slots, late arrivals: each gives plain decoding's tokens."""
    model, tokenizer, _, _ = models
    settings = CACHES[cache]
    requests = [GenerationRequest(p, max_tokens=m) for p, m in zip(PROMPTS, MAX_TOKENS)]
    requests[1].sampling = SamplingSettings(repetition_penalty=1.3)
    requests[4].speculate = False
    allowed = list(range(50, 60))
    requests.append(GenerationRequest(PROMPTS[0], max_tokens=7, constraint=AllowedTokens(allowed, 256, 7)))
    expected = [plain_tokens(model, tokenizer, r, settings) for r in requests[:-1]]
    expected.append(plain_tokens(model, tokenizer, requests[-1], settings, AllowedTokens(allowed, 256, 7)))
    with Engine(model, tokenizer, max_batch=3, cache_settings=settings, prefill_chunk=CHUNK, prefix_cache_bytes=0,
                speculative=speculative_settings(kind, models)) as engine:
        handles = [engine.submit(r) for r in requests[:3]]
        first = next(iter(handles[0]))  # the rest arrive while the first ones decode
        handles += [engine.submit(r) for r in requests[3:]]
        results = [collect(h) for h in handles]
    results[0] = ([first.token, *results[0][0]], results[0][1])
    for (tokens, events), reference, request in zip(results, expected, requests):
        assert tokens == reference
        assert events[-1].completion_tokens == request.max_tokens
        assert events[-1].finish_reason == ("stop" if request.constraint else "length")  # a done constraint stops
    finals = [events[-1] for _, events in results]
    assert finals[4].proposed_tokens == 0 and finals[-1].proposed_tokens == 0  # opted out, constrained
    assert set(results[-1][0]) <= set(allowed)
    speculating = [f for i, f in enumerate(finals) if i not in (4, len(finals) - 1)]
    assert all(0 <= f.accepted_tokens <= f.proposed_tokens for f in finals)
    if kind == "lookup":  # proposals only where an n-gram recurs (a random model rarely repeats)
        assert sum(f.proposed_tokens for f in speculating) > 0
    else:  # a draft always proposes
        assert all(f.proposed_tokens > 0 for f in speculating)
    if kind == "self-draft":  # the target drafting for itself: multi-token rounds are accepted
        assert sum(f.accepted_tokens for f in speculating) > 0.8 * sum(f.proposed_tokens for f in speculating)

def test_logprobs_and_logit_bias_against_transformers(models):
    """Several tokens per round, each with the logprob of its own verification row (after the
    logit bias), equal to transformers' log-softmax of the biased logits; greedy on them."""
    import torch

    model, tokenizer, hf_model, _ = models
    bias = {7: 2.0, 8: 2.0, 60: -3.0}
    ids = PROMPTS[0]
    request = GenerationRequest(ids, max_tokens=16, logprobs=3, sampling=SamplingSettings(logit_bias=bias))
    with Engine(model, tokenizer, speculative=speculative_settings("self-draft", models)) as engine:
        other = engine.submit(GenerationRequest(PROMPTS[3], max_tokens=10))
        tokens, events = collect(engine.submit(request))
        collect(other)
    assert events[-1].accepted_tokens >= 8
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1 :].double()
    for token, value in bias.items():
        logits[:, token] += value
    reference = torch.log_softmax(logits, dim=-1).numpy()
    assert tokens == list(reference.argmax(axis=-1))
    for step, event in enumerate(events):
        assert event.logprob == pytest.approx(reference[step, event.token], abs=2e-3)
        top = [t for t, _ in event.top_logprobs]
        assert top == list(np.argsort(-reference[step])[:3])
        assert [v for _, v in event.top_logprobs] == pytest.approx(list(reference[step][top]), abs=2e-3)


@pytest.mark.parametrize("kind", ["lookup", "other-draft"])
def test_seeded_sampling_is_reproducible_beside_others(models, kind):
    model, tokenizer, _, _ = models
    sampled = GenerationRequest(PROMPTS[0], max_tokens=20, sampling=SamplingSettings(temp=1.0, top_k=8, seed=5))
    with Engine(model, tokenizer, speculative=speculative_settings(kind, models)) as engine:
        alone, events = collect(engine.submit(sampled))
        others = [engine.submit(GenerationRequest(p, max_tokens=20, sampling=SamplingSettings(temp=1.0)))
                  for p in PROMPTS[1:4]]
        together, _ = collect(engine.submit(sampled))
        for handle in others:
            collect(handle)
        reseeded = GenerationRequest(PROMPTS[0], 20, SamplingSettings(temp=1.0, top_k=8, seed=6))
        assert collect(engine.submit(reseeded))[0] != alone
    assert together == alone and len(alone) == 20
    assert events[-1].proposed_tokens > 0


def test_prefix_cache_holds_exactly_the_tokens_after_rewinds(models):
    """A stop string ends a request inside a speculation round: the cache the prefix cache keeps
    holds exactly prompt + output but the last token (the keys of a fresh prefill of them), and a
    follow-up request reusing it gives plain decoding's tokens."""
    model, tokenizer, _, _ = models
    ids = PROMPTS[3]
    plain = plain_tokens(model, tokenizer, GenerationRequest(ids, max_tokens=30))
    stop_at = next(i for i in range(9, 30) if plain[i] not in plain[:i] and i % 4 != 0)
    stop = [tokenizer.decode([plain[stop_at]]).strip()]
    request = GenerationRequest(ids, max_tokens=30, stop=stop)
    expected = plain_tokens(model, tokenizer, request)
    assert len(expected) == stop_at + 1
    # one-token blocks: the prefix cache keeps every token, the rewound tail included
    tiers = PromptCacheSettings(block_size=1)
    with Engine(model, tokenizer, prefill_chunk=CHUNK, speculative=speculative_settings("self-draft", models),
                prompt_cache=tiers) as engine:
        tokens, events = collect(engine.submit(request))
        assert tokens == expected and events[-1].finish_reason == "stop"
        assert events[-1].accepted_tokens > 0
        key = ids + tokens[:-1]
        assert engine.prefix_cache.cached_blocks(engine.prefix_cache.keys_for(key + [tokens[-1]])) == len(key)
        hit, n = engine.prefix_cache.lookup(key + [tokens[-1]])
        assert n == len(key)
        fresh = make_cache(model)
        mx.eval(model.hidden_states(mx.array([list(key)]), fresh))
        for kept, reference in zip(hit, fresh):
            assert kept.offset == len(key)
            for a, b in zip(kept.keys + kept.values, reference.state):
                assert a.shape == b.shape and mx.allclose(a, b, atol=1e-4).item()
        follow = GenerationRequest(list(key) + [tokens[-1], 50, 51], max_tokens=12)
        again, follow_events = collect(engine.submit(follow))
        assert follow_events[-1].cached_tokens == len(key)
    assert again == plain_tokens(model, tokenizer, follow)


def test_real_model_prompt_lookup_in_a_batch(smollm):
    """SmolLM2 asked to repeat texts: with prompt lookup, most proposals hold, and each output is
    plain decoding's alone."""
    model, tokenizer = smollm
    texts = ["The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
             "Roses are red, violets are blue, sugar is sweet, and so are you."]
    requests = [GenerationRequest(tokenizer.encode_prompt(f"Repeat this text exactly: {t}"), max_tokens=10)
                for t in texts]
    expected = [plain_tokens(model, tokenizer, r) for r in requests]
    speculative = SpeculativeSettings(prompt_lookup=True, num_draft_tokens=6)
    with Engine(model, tokenizer, prefill_chunk=CHUNK * 16, speculative=speculative) as engine:
        results = [collect(h) for h in [engine.submit(r) for r in requests]]
    assert [tokens for tokens, _ in results] == expected
    assert all(events[-1].accepted_tokens >= 4 for _, events in results)  # of at most 9


def test_batch_generate_with_speculation_and_bad_draft(models, tmp_path):
    model, tokenizer, _, _ = models
    texts = [" ".join(f"w{t}" for t in p) for p in PROMPTS[:3]]
    plain = batch_generate(model, tokenizer, texts, 10)
    assert batch_generate(model, tokenizer, texts, 10, speculative=speculative_settings("lookup", models)) == plain
    other, other_tokenizer, _ = tiny_words(tmp_path, vocab_size=200)
    with pytest.raises(MlxformerError, match="tokenizer differs"):
        Engine(model, tokenizer, speculative=SpeculativeSettings(draft_model=other, draft_tokenizer=other_tokenizer))
