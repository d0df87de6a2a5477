"""A seeded fuzz of the engine (issue 43): random staggered requests with shared prefixes
(prefix-cache hits), a seeded sampled one and a cancellation, over every cache kind (float,
8-bit KV with and without ``quantized_kv_start``, a rotating window, MLA, a hybrid) and a KV
budget; every request that is not cancelled equals itself alone (a fresh engine, no prefix
cache): its tokens and their log-probabilities."""

from __future__ import annotations

import itertools
import random

import pytest

from conftest import tiny_byte_llama_of
from mlxformer.cache import CacheSettings
from mlxformer.engine import Engine, GenerationRequest
from mlxformer.engine.memory import KVSizer
from mlxformer.sampling.options import SamplingSettings
from test_zero_copy_join import HYBRID, MLA, tiny_model

KINDS = {
    "float": ("llama", CacheSettings(), False),
    "kv8": ("llama", CacheSettings(kv_bits=8, kv_group_size=32), False),
    "kv8-start": ("llama", CacheSettings(kv_bits=8, kv_group_size=32, quantized_kv_start=40), False),
    "rotating": ("llama", CacheSettings(max_kv_size=72, keep=2), False),
    "float-budget": ("llama", CacheSettings(), True),
    "kv8-start-budget": ("llama", CacheSettings(kv_bits=8, kv_group_size=32, quantized_kv_start=40), True),
    "mla": ("mla", CacheSettings(), False),
    "hybrid": ("hybrid", CacheSettings(), False),
}
CHUNK = 32


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {
        "llama": tiny_byte_llama_of(tmp_path_factory.mktemp("fuzz_llama"), 2),
        "mla": tiny_model(tmp_path_factory.mktemp("fuzz_mla"), "deepseek_v2", **MLA),
        "hybrid": tiny_model(tmp_path_factory.mktemp("fuzz_hybrid"), "qwen3_5_text", **HYBRID),
    }


def requests_for(seed: int) -> list[GenerationRequest]:
    """Six prompts over two shared prefixes (40-90 tokens) with their own tails; one samples."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 250) for _ in range(rng.randrange(40, 90))] for _ in range(2)]
    requests = []
    for i in range(6):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 250) for _ in range(rng.randrange(3, 30))]
        sampling = SamplingSettings(temp=0.8, top_k=20, seed=seed + i) if i == 3 else SamplingSettings()
        requests.append(GenerationRequest(prompt, rng.randrange(4, 11), sampling, logprobs=0))
    return requests


def reply(events) -> list[tuple[int, float]]:
    return [(e.token, round(e.logprob, 5)) for e in events if e.token is not None]


def engine_for(models, kind: str, requests: list[GenerationRequest], **options) -> Engine:
    family, settings, budgeted = KINDS[kind]
    model, tokenizer = models[family]
    if budgeted:  # room for about three requests at once: others wait, some are preempted
        longest = max(len(r.prompt_ids) + r.max_tokens for r in requests)
        options["max_kv_memory"] = 3 * KVSizer(model, settings).peak(longest)
    return Engine(model, tokenizer, max_batch=4, cache_settings=settings, prefill_chunk=CHUNK,
                  step_tokens=2 * CHUNK, **options)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", list(KINDS))
def test_staggered_requests_with_hits_and_a_cancellation_equal_each_alone(models, kind, seed):
    rng = random.Random(100 + seed)
    requests = requests_for(seed)
    cancelled = rng.randrange(len(requests))
    with engine_for(models, kind, requests, prefix_cache_bytes=2**26) as engine:
        handles, streams, got = [], [], {}
        for i, request in enumerate(requests):
            handles.append(engine.submit(request))
            streams.append(iter(handles[-1]))
            if i == cancelled:
                next(streams[i])
                handles[i].cancel()
            elif rng.random() < 0.6:  # let the earlier ones run a little: staggered arrivals
                j = rng.randrange(i + 1)
                if j != cancelled:
                    got.setdefault(j, []).extend(itertools.islice(streams[j], rng.randrange(1, 3)))
        for i, stream in enumerate(streams):
            if i != cancelled:
                got.setdefault(i, []).extend(stream)
        assert sum(h.sequence.cached_tokens for h in handles) > 0  # prefix hits happened
    for i, request in enumerate(requests):
        if i == cancelled:
            continue
        with engine_for(models, kind, [request], prefix_cache_bytes=0) as alone:
            assert reply(got[i]) == reply(alone.submit(request)), (kind, seed, i)
