"""The engine under hostile input (issue 43): one request's bad settings never end another's
stream, a prefix-cache hit serves what a cold prefill would hold, a long prompt is not starved
by a stream of short ones."""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlxformer.engine.delivery as delivery_module
from conftest import tiny_byte_llama_of
from mlxformer.cache import CacheSettings
from mlxformer.engine import Engine, GenerationRequest
from mlxformer.errors import OptionError
from mlxformer.sampling.options import SamplingSettings

PROMPT = [(5 * j) % 200 + 20 for j in range(24)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_byte_llama_of(tmp_path_factory.mktemp("hostile"), layers=2)


def tokens_of(handle) -> tuple[list[int], list[float]]:
    events = list(handle)
    return [e.token for e in events if e.token is not None], [e.logprob for e in events if e.token is not None]


def alone(tiny, request: GenerationRequest, **engine) -> tuple[list[int], list[float]]:
    model, tokenizer = tiny
    with Engine(model, tokenizer, prefix_cache_bytes=0, **engine) as e:
        return tokens_of(e.submit(request))


def test_top_k_past_int32_is_refused_and_past_the_vocabulary_keeps_it_whole(tiny):
    with pytest.raises(OptionError, match="top_k"):
        SamplingSettings(temp=1.0, top_k=2**31)
    model, tokenizer = tiny
    greedy = GenerationRequest(PROMPT, 8, logprobs=0)
    wide = GenerationRequest(PROMPT[:10], 8, SamplingSettings(temp=0.8, top_k=2**31 - 1, seed=7), logprobs=0)
    with Engine(model, tokenizer, prefix_cache_bytes=0) as engine:
        handles = [engine.submit(greedy), engine.submit(wide)]
        got = [tokens_of(h) for h in handles]
    assert got[0] == alone(tiny, greedy)
    assert got[1] == alone(tiny, wide)
    assert len(got[1][0]) == 8


def test_a_row_whose_choice_fails_ends_alone(tiny, monkeypatch):
    """A failure while building the step's one sampling graph is found row by row: only the row
    whose settings fail ends (before: every request in flight ended with it)."""
    real = delivery_module.choose

    def choose(logits, rows, pending=None):
        if any(r.sampling.seed == 666 for r in rows):
            raise RuntimeError("injected choice fault")
        return real(logits, rows, pending)

    model, tokenizer = tiny
    good = GenerationRequest(PROMPT, 8, logprobs=0)
    bad = GenerationRequest(PROMPT[:12], 8, SamplingSettings(temp=0.5, seed=666))
    reference = alone(tiny, good)
    monkeypatch.setattr(delivery_module, "choose", choose)
    with Engine(model, tokenizer, prefix_cache_bytes=0) as engine:
        handles = [engine.submit(good), engine.submit(bad)]
        assert tokens_of(handles[0]) == reference
        with pytest.raises(RuntimeError, match="injected choice fault"):
            list(handles[1])
        assert engine.running


def test_a_prefix_hit_below_quantized_kv_start_equals_a_cold_prefill(tiny):
    """A finished 100-token sequence's blocks are quantized (it crossed ``quantized_kv_start``);
    a prompt sharing 40 of its tokens must not be served those quantized keys: a cold prefill of
    40 tokens holds them as floats (before: greedy tokens differed from the cold run)."""
    model, tokenizer = tiny
    settings = CacheSettings(kv_bits=8, kv_group_size=32, quantized_kv_start=64)
    first = [(7 * j) % 230 + 10 for j in range(100)]
    second = first[:40] + [(3 * j) % 200 + 30 for j in range(8)]
    cold = alone(tiny, GenerationRequest(second, 12, logprobs=0), cache_settings=settings)
    with Engine(model, tokenizer, cache_settings=settings, prefix_cache_bytes=2**26) as engine:
        tokens_of(engine.submit(GenerationRequest(first, 4)))
        handle = engine.submit(GenerationRequest(second, 12, logprobs=0))
        warm = tokens_of(handle)
    assert warm == cold


def drive(scheduler, long_prompt: int, arrivals: int) -> int:
    """Run the scheduler's plans as the engine would (each short request decodes one token and
    ends), a short request arriving every step for ``arrivals`` steps; the step at which the
    long prompt's last chunk runs."""
    from mlxformer.engine.request_state import RequestState

    def request(n: int, first: int) -> RequestState:
        return RequestState(GenerationRequest([first + j % 50 for j in range(n)], 1), None, [])

    long = request(long_prompt, 1)
    scheduler.add(long)
    for step in range(1, 10_000):
        if step <= arrivals:
            scheduler.add(request(20, 100))
        scheduler.admit()
        plan = scheduler.plan()
        for sequence in plan.decode:
            scheduler.release(sequence)
        for chunk in plan.prefill:
            chunk.sequence.processed += len(chunk.tokens)
            if chunk.last:
                if chunk.sequence is long:
                    return step
                scheduler.start_decoding(chunk.sequence)
    raise AssertionError("the long prompt never finished")


def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones():
    """The CPU defaults (128 tokens a step): a 1,000-token prompt alone takes 8 steps; with a
    short request arriving at every one of 600 steps it used to finish at step 608 (newcomers
    first, then shortest remaining). Aging gives it a chunk at least every MAX_PREFILL_WAIT + 1
    steps."""
    from mlxformer.engine.scheduler import MAX_PREFILL_WAIT, Scheduler

    make = lambda: Scheduler(max_batch=64, max_queue=64, prefill_chunk=128, step_tokens=128)  # noqa: E731
    assert drive(make(), 1000, 0) == 8
    assert drive(make(), 1000, 600) <= 8 * (MAX_PREFILL_WAIT + 1)


def host_bytes_per_step(context: int) -> int:
    """Peak bytes the host allocates to build one step's sampling graph (``RequestState.row`` and
    ``choose``, not evaluated) for 8 sequences of ``context`` prompt tokens that have generated
    a few tokens, every penalty on in half the rows, after a warm step (a counted measure, not a
    timed one)."""
    import tracemalloc

    from mlxformer.sampling.choosing import choose
    from mlxformer.engine.request_state import RequestState

    vocab = 256
    settings = SamplingSettings(temp=0.7, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3, seed=3)
    plain = SamplingSettings(temp=0.7, seed=5)  # half the rows without penalties, beside the others
    sequences = [RequestState(GenerationRequest([(i + j) % 250 for j in range(context)], 64, settings if i % 2 else plain),
                          None, []) for i in range(8)]
    logits = mx.random.normal((8, vocab), key=mx.random.key(0))
    for step in range(3):
        for s in sequences:
            s.generated.append(step + 1)
        if step < 2:  # warm: the running counts start from the generated tokens
            mx.eval(choose(logits, [s.choice_row(0, vocab) for s in sequences]))
            continue
        tracemalloc.start()
        choose(logits, [s.choice_row(0, vocab) for s in sequences])
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_host_work_per_step_does_not_grow_with_the_context():
    """Before: every row copied its whole token history each step (batch 8 at 32k tokens: 2 MiB
    a step) and the presence/frequency penalties re-uploaded every generated token. (128 tokens:
    the repetition penalty's 64-token window is full, the one part that grows below that.)"""
    short, long = host_bytes_per_step(128), host_bytes_per_step(32768)
    assert long <= 1.5 * short, (short, long)


def test_prompt_lookup_rounds_cost_the_new_tokens_only():
    import tracemalloc

    from mlxformer.sampling.choosing import History
    from mlxformer.speculative.speculator import PromptLookupProposer

    def round_bytes(context: int) -> int:
        prompt = [(7 * j) % 97 for j in range(context)]
        generated: list[int] = []
        proposer = PromptLookupProposer()
        proposer.propose(History(prompt, generated), 4)  # indexes the prompt once
        generated += [5, 6]
        tracemalloc.start()
        proposer.propose(History(prompt, generated), 4)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak

    assert round_bytes(32768) <= 1.5 * round_bytes(64)


def test_a_prompt_published_chunk_by_chunk_is_hashed_once(tiny, monkeypatch):
    """While a newcomer waits for a shared prefix, the prefilling prompt publishes its blocks
    after every chunk; each publish used to hash the whole prefix again (quadratic in the
    prompt: ~1.5 s of the engine's thread over a 128k prompt). Counted: blocks hashed."""
    import mlxformer.engine.prefix_cache as prefix_cache_module

    hashed = []
    real = prefix_cache_module.block_keys

    def counting(seed, tokens, block_size, count=None):
        keys = real(seed, tokens, block_size, count)
        hashed.append(len(keys))
        return keys

    monkeypatch.setattr(prefix_cache_module, "block_keys", counting)
    model, tokenizer = tiny
    first = [(11 * j) % 240 + 5 for j in range(1024)]
    second = first[:960] + [7, 8, 9]
    with Engine(model, tokenizer, prefill_chunk=32, step_tokens=64, prefix_cache_bytes=2**26) as engine:
        handles = [engine.submit(GenerationRequest(first, 2)), engine.submit(GenerationRequest(second, 2))]
        for handle in handles:
            list(handle)
        assert handles[1].sequence.cached_tokens >= 928  # it waited for the shared blocks
    blocks = (len(first) + len(second)) // 32
    assert sum(hashed) <= 3 * blocks, (sum(hashed), blocks)


def test_a_default_max_tokens_is_what_the_budget_holds_not_a_refusal(tiny):
    """OpenAI clients send no max_tokens: the default is the rest of the context, which a KV
    budget smaller than one full context refused (a 400 under ``--max-kv-memory auto`` on a
    128k model). The default is now cut to what the budget can hold for the prompt."""
    from mlxformer.engine import KVBudgetExceeded
    from mlxformer.engine.memory import KVSizer

    model, tokenizer = tiny
    rest = model.args.max_position_embeddings - len(PROMPT)
    budget = KVSizer(model, CacheSettings()).peak(len(PROMPT) + 300)
    with Engine(model, tokenizer, max_kv_memory=budget, prefix_cache_bytes=0) as engine:
        with pytest.raises(KVBudgetExceeded):
            engine.submit(GenerationRequest(PROMPT, rest))  # the client's own max_tokens: refused
        events = list(engine.submit(GenerationRequest(PROMPT, rest, fit_budget=True)))
    assert events[-1].finish_reason == "length" and 300 <= events[-1].completion_tokens < rest


def test_the_server_leaves_a_missing_max_tokens_to_the_budget(tiny):
    from mlxformer.server.protocol import ChatCompletionRequest
    from mlxformer.server.translate import ServedModel, engine_request

    model, tokenizer = tiny
    served = ServedModel.of("tiny", model, tokenizer)
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    assert engine_request(body, PROMPT, served, max_tokens=None, logprobs=None).fit_budget
    assert not engine_request(body, PROMPT, served, max_tokens=5, logprobs=None).fit_budget


def test_a_newcomer_waiting_on_a_prefix_past_a_narrow_window_is_served_from_it(tmp_path):
    """A sliding window narrower than a chunk plus a block (Mistral, window 24; chunks of 64):
    a newcomer sharing 180 tokens of a prompt being prefilled waited for blocks that could never
    serve it, then prefilled cold (issue 43: first token at step 25 instead of 14, 0 tokens from
    the cache). The shared prefix now serves up to the last chunk end inside it, and the reply
    equals the newcomer's alone."""
    from test_zero_copy_join import sliding_model

    model, tokenizer = sliding_model(tmp_path, "mistral", 24, 2)
    first = [(13 * j) % 240 + 5 for j in range(260)]
    second = first[:180] + [9, 8, 7, 6]
    request = GenerationRequest(second, 6, logprobs=0)
    with Engine(model, tokenizer, prefill_chunk=64, step_tokens=128, prefix_cache_bytes=0) as alone_engine:
        reference = tokens_of(alone_engine.submit(request))
    with Engine(model, tokenizer, prefill_chunk=64, step_tokens=128, prefix_cache_bytes=2**26) as engine:
        handles = [engine.submit(GenerationRequest(first, 2)), engine.submit(request)]
        got = [tokens_of(h) for h in handles]
        assert handles[1].sequence.cached_tokens >= 128
    assert got[1] == reference


ALONE_CASES = [  # (cache settings, prompt tokens, max_tokens): storage turning quantized before, at, after the end
    (CacheSettings(), 500, 40),
    (CacheSettings(kv_bits=8, kv_group_size=32), 240, 20),
    (CacheSettings(kv_bits=8, kv_group_size=32, quantized_kv_start=250), 250, 2),
    (CacheSettings(kv_bits=8, kv_group_size=32, quantized_kv_start=300), 250, 10),
    (CacheSettings(kv_bits=8, kv_group_size=32, quantized_kv_start=300), 60, 300),
    (CacheSettings(kv_bits=8, kv_group_size=32, quantized_kv_start=300), 300, 5),
    (CacheSettings(max_kv_size=72, keep=2), 200, 40),
]


@pytest.mark.parametrize("settings,prompt,max_tokens", ALONE_CASES)
def test_a_request_admitted_alone_completes_alone(tiny, settings, prompt, max_tokens):
    """A budget of exactly what the check asks for a request (``KVSizer.peak``: the one estimate,
    ``after``, at each growth and as its storage turns quantized) runs it to its end alone, and
    the bytes its caches hold never pass the budget. Before, with ``quantized_kv_start`` past a
    block, the check sized a float row as quantized: 4 of these failed alone ("the request
    outgrew the KV memory budget")."""
    model, tokenizer = tiny
    budget = Engine(model, tokenizer, cache_settings=settings).sizer.peak(prompt + max_tokens)
    ids = [(7 * j) % 250 + 1 for j in range(prompt)]
    with Engine(model, tokenizer, max_kv_memory=budget, cache_settings=settings, prefix_cache_bytes=0,
                prefill_chunk=64) as engine:
        held, step = [], engine.step

        def recorded_step() -> None:
            step()
            held.append(engine.kv_bytes())

        engine.step = recorded_step  # type: ignore[method-assign]
        events = list(engine.submit(GenerationRequest(ids, max_tokens)))
    assert sum(e.token is not None for e in events) == max_tokens
    assert 0 < max(held) <= budget, (max(held), budget)
