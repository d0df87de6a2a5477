"""The continuous-batching engine: every sequence of a batch gives what it gives alone through
``generate`` (greedy and seeded sampling, float / 8-bit / rotating caches, mixed settings,
sequences joining mid-way), cancellation, the queue bound,
logprobs against transformers, and a token constraint."""

from __future__ import annotations

import asyncio
import mlx.core as mx
import numpy as np
import pytest

from conftest import write_tiny_checkpoint
from mlxformer import generate, load, stream_generate
from mlxformer.cache import CacheSettings
from mlxformer.engine import Engine, EngineOverloaded, GenerationRequest, TokenEvent, batch_generate
from mlxformer.errors import MlxformerError
from mlxformer.generation.stream import SamplingSettings

CHUNK = 16  # small prefill chunks, so that prompts span several
PROMPTS = [
    "Once upon a time,",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "1 2 3",
    "In the beginning there was nothing but a long, winding road that led from the old mill to the sea,",
    "Hello",
    "Q: What is the capital of France?\nA:",
]


@pytest.fixture(scope="module")
def tiny(smollm, tmp_path_factory):
    """A tiny random Llama (head_dim 64, so 8-bit KV groups fit) with SmolLM2's tokenizer,
    and the transformers float32 model it was saved from."""
    directory, hf_model = write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_engine"), "llama", vocab_size=49152, tie_word_embeddings=True,
        hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
    )
    smollm[1].save(directory)
    model, tokenizer = load(directory, dtype=mx.float32)  # like the transformers reference, on any device
    return model, tokenizer, hf_model


def collect(handle) -> tuple[str, list[int], list[TokenEvent]]:
    events = list(handle)
    return "".join(e.text for e in events), [e.token for e in events if e.token is not None], events


def reference(model, tokenizer, ids, request: GenerationRequest, cache_settings=None) -> tuple[str, list[int]]:
    responses = list(stream_generate(
        model, tokenizer, ids, request.max_tokens, sampling=request.sampling, stop=request.stop,
        cache_settings=cache_settings, prefill_step_size=CHUNK,
    ))
    return "".join(r.text for r in responses), [r.token for r in responses]


CACHES = {
    "float": None,
    "kv8": CacheSettings(kv_bits=8, kv_group_size=32),
    "rotating": CacheSettings(max_kv_size=40, keep=4),
}


@pytest.mark.parametrize("cache", list(CACHES))
def test_batch_matches_alone(tiny, cache):
    """Mixed prompt lengths and settings (max tokens, stop strings, seeded sampling), more
    requests than slots, and late arrivals: each output equals its ``generate`` alone."""
    model, tokenizer, _ = tiny
    settings = CACHES[cache]
    requests = []
    for i, prompt in enumerate(PROMPTS):
        sampling = SamplingSettings(temp=0.8, top_k=20, seed=100 + i) if i % 3 == 2 else SamplingSettings()
        requests.append(GenerationRequest(
            tokenizer.encode(prompt), max_tokens=[12, 30, 20, 25, 8, 16][i], sampling=sampling,
            stop=[" the"] if i == 3 else (),
        ))
    expected = [reference(model, tokenizer, r.prompt_ids, r, settings) for r in requests]
    with Engine(model, tokenizer, max_batch=3, cache_settings=settings, prefill_chunk=CHUNK,
                prefix_cache_bytes=0) as engine:
        handles = [engine.submit(r) for r in requests[:4]]
        first = next(iter(handles[0]))  # the rest arrive while the first ones decode
        handles += [engine.submit(r) for r in requests[4:]]
        results = [collect(h) for h in handles]
    results[0] = (first.text + results[0][0], [first.token] + results[0][1], results[0][2])
    for (text, tokens, events), (ref_text, ref_tokens), request in zip(results, expected, requests):
        assert tokens == ref_tokens
        assert text == ref_text
        assert events[-1].finish_reason in ("stop", "length")
        assert events[-1].prompt_tokens == len(request.prompt_ids)
        assert events[-1].completion_tokens == len(ref_tokens)


def test_batch_generate_and_threads_1(tiny, tmp_path):
    model, tokenizer, hf_model = tiny
    expected = [generate(model, tokenizer, p, 10) for p in PROMPTS[:4]]
    assert batch_generate(model, tokenizer, PROMPTS[:4], 10, max_batch=4) == expected
    hf_model.save_pretrained(tmp_path)  # the same weights, loaded unsharded (threads=1)
    tokenizer.save(tmp_path)
    single, single_tokenizer = load(tmp_path, threads=1)
    assert batch_generate(single, single_tokenizer, PROMPTS[:4], 10, max_batch=2) == expected


def test_real_model_batch_matches_alone(smollm):
    model, tokenizer = smollm
    prompts = ["The capital of France is", "def add(a, b):", "Roses are red,"]
    expected = [generate(model, tokenizer, p, 6) for p in prompts]
    assert batch_generate(model, tokenizer, prompts, 6) == expected


def test_cancel_frees_the_slot(tiny):
    model, tokenizer, _ = tiny
    ids = tokenizer.encode(PROMPTS[0])
    with Engine(model, tokenizer, max_batch=1, max_queue=4) as engine:
        long = engine.submit(GenerationRequest(ids, max_tokens=10_000))
        waiting = engine.submit(GenerationRequest(ids, max_tokens=10_000))
        events = iter(long)
        next(events)
        waiting.cancel()  # never admitted
        assert list(waiting)[-1].finish_reason == "cancelled"
        long.cancel()
        rest = list(events)
        assert rest[-1].finish_reason == "cancelled" and len(rest) < 10_000
        text, tokens, _ = collect(engine.submit(GenerationRequest(ids, max_tokens=5)))
        assert len(tokens) == 5 and engine.active == 0


def test_queue_overflow(tiny):
    model, tokenizer, _ = tiny
    ids = tokenizer.encode("Hi")
    with Engine(model, tokenizer, max_batch=1, max_queue=2) as engine:
        long = engine.submit(GenerationRequest(ids, max_tokens=10_000))
        next(iter(long))  # it holds the only slot: the next ones wait
        handles = [engine.submit(GenerationRequest(ids, max_tokens=3)) for _ in range(2)]
        with pytest.raises(EngineOverloaded):
            engine.submit(GenerationRequest(ids, max_tokens=3))
        long.cancel()  # the queued ones complete
        assert all(len(collect(h)[1]) == 3 for h in handles)


@pytest.mark.parametrize("bad", [
    dict(prompt_ids=[]), dict(prompt_ids=[10**6]), dict(max_tokens=0), dict(logprobs=-1),
    dict(sampling=SamplingSettings(logit_bias={10**6: 1.0})),
])
def test_invalid_requests_are_refused(tiny, bad):
    model, tokenizer, _ = tiny
    engine = Engine(model, tokenizer)
    with pytest.raises(MlxformerError):
        engine.submit(GenerationRequest(**{"prompt_ids": [1, 2], **bad}))
    assert not engine.scheduler.has_work()


def test_seed_reproducible_regardless_of_companions(tiny):
    model, tokenizer, _ = tiny
    sampled = GenerationRequest(tokenizer.encode(PROMPTS[0]), max_tokens=15,
                                sampling=SamplingSettings(temp=1.0, seed=7))
    with Engine(model, tokenizer) as engine:
        alone = collect(engine.submit(sampled))[1]
        others = [engine.submit(GenerationRequest(tokenizer.encode(p), max_tokens=15,
                                                  sampling=SamplingSettings(temp=1.0))) for p in PROMPTS[1:4]]
        together = collect(engine.submit(sampled))[1]
        for h in others:
            collect(h)
        other_seed = GenerationRequest(sampled.prompt_ids, 15, SamplingSettings(temp=1.0, seed=8))
        assert collect(engine.submit(other_seed))[1] != alone
    assert together == alone
    assert alone == reference(model, tokenizer, sampled.prompt_ids, sampled)[1]


def test_logprobs_match_transformers(tiny):
    import torch

    model, tokenizer, hf_model = tiny
    ids = tokenizer.encode(PROMPTS[5])
    with Engine(model, tokenizer) as engine:
        other = engine.submit(GenerationRequest(tokenizer.encode(PROMPTS[1]), max_tokens=8))
        _, tokens, events = collect(engine.submit(GenerationRequest(ids, max_tokens=8, logprobs=3)))
        collect(other)
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1 :]
    reference_lp = torch.log_softmax(logits.double(), dim=-1).numpy()
    for step, event in enumerate(events):
        assert event.logprob == pytest.approx(reference_lp[step, event.token], abs=2e-3)
        top_ids = [t for t, _ in event.top_logprobs]
        assert top_ids == list(np.argsort(-reference_lp[step])[:3])
        assert [v for _, v in event.top_logprobs] == pytest.approx(list(reference_lp[step][top_ids]), abs=2e-3)


class AllowedTokens:
    """A test constraint: only ``allowed`` ids, done after ``length`` tokens."""

    def __init__(self, allowed: list[int], vocab: int, length: int) -> None:
        mask = np.zeros(vocab, dtype=bool)
        mask[allowed] = True
        self.mask, self.length, self.seen = mx.array(mask), length, []

    def next_mask(self):
        return self.mask

    def advance(self, token: int) -> None:
        self.seen.append(token)

    @property
    def done(self) -> bool:
        return len(self.seen) >= self.length


def test_constraint_is_respected(tiny):
    model, tokenizer, _ = tiny
    allowed = [tokenizer.encode(str(d))[0] for d in range(10)]
    constraint = AllowedTokens(allowed, model.args.vocab_size, length=6)
    with Engine(model, tokenizer) as engine:
        free = engine.submit(GenerationRequest(tokenizer.encode(PROMPTS[0]), max_tokens=10))
        _, tokens, events = collect(engine.submit(GenerationRequest(
            tokenizer.encode(PROMPTS[0]), max_tokens=50, sampling=SamplingSettings(temp=1.0, seed=3),
            constraint=constraint)))
        collect(free)
    assert len(tokens) == 6 and set(tokens) <= set(allowed) and constraint.seen == tokens
    assert events[-1].finish_reason == "stop"


class Broken(AllowedTokens):
    def next_mask(self):
        raise RuntimeError("broken constraint")


def test_a_failing_request_ends_alone(tiny):
    model, tokenizer, _ = tiny
    ids = tokenizer.encode(PROMPTS[0])
    with Engine(model, tokenizer) as engine:
        fine = engine.submit(GenerationRequest(ids, max_tokens=6))
        broken = engine.submit(GenerationRequest(ids, max_tokens=6, constraint=Broken([1], model.args.vocab_size, 3)))
        with pytest.raises(RuntimeError, match="broken constraint"):
            list(broken)
        assert collect(fine)[0] == generate(model, tokenizer, ids, 6)
        assert len(collect(engine.submit(GenerationRequest(ids, max_tokens=4)))[1]) == 4


def test_async_iteration(tiny):
    model, tokenizer, _ = tiny
    ids = tokenizer.encode(PROMPTS[2])
    expected = generate(model, tokenizer, ids, 12)

    async def run(engine):
        handles = [engine.submit(GenerationRequest(ids, max_tokens=12)) for _ in range(2)]

        async def text(h):
            return "".join([e.text async for e in h.aiter()])

        return await asyncio.gather(*(text(h) for h in handles))

    with Engine(model, tokenizer) as engine:
        assert asyncio.run(run(engine)) == [expected, expected]
