"""Host syncs, counted by a hook on every way MLX hands values to Python (``mx.eval``,
``array.item``, ``array.tolist``): one per speculative round (greedy, sampled and penalised; prompt lookup
and a draft model), one per single-stream decode step, one per engine decode step at batch 1
and 4 (greedy, and sampled with logprobs); prompt lookup's n-gram index answers what a rescan
of the history answers."""

from __future__ import annotations

import contextlib
import random

import mlx.core as mx
import pytest

from conftest import write_tiny_byte_llama
from mlxformer import load, stream_generate
from mlxformer.generation.decoding import open_sequence
from mlxformer.engine import Engine, GenerationRequest
from mlxformer.engine.scheduler import Step
from mlxformer.sampling.options import SamplingSettings
from mlxformer.speculative.speculator import PromptLookupProposer, SpeculativeSettings
from mlxformer.generation.steps import prefill


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


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    """Another tiny random Llama with the same byte tokenizer: a draft model."""
    return load(write_tiny_byte_llama(tmp_path_factory.mktemp("tiny_draft"), seed=1), dtype=mx.float32)


SAMPLED = SamplingSettings(temp=0.8, top_p=0.9, seed=3)
PENALIZED = SamplingSettings(temp=0.8, top_p=0.9, seed=3, repetition_penalty=1.1)
GREEDY_PENALIZED = SamplingSettings(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3)


@pytest.mark.parametrize("proposer,sampling", [("lookup", SamplingSettings()), ("lookup", PENALIZED),
                                               ("draft", SamplingSettings()), ("draft", SAMPLED),
                                               ("draft", PENALIZED), ("draft", GREEDY_PENALIZED)],
                         ids=["lookup-greedy", "lookup-penalized", "draft-greedy", "draft-sampled",
                              "draft-penalized", "draft-greedy-penalized"])
def test_one_sync_per_speculative_round(tiny_byte_llama, tiny_draft, proposer, sampling, monkeypatch):
    model, tokenizer = tiny_byte_llama
    speculative = (SpeculativeSettings(num_draft_tokens=4, prompt_lookup=True, ngram_min=1) if proposer == "lookup"
                   else SpeculativeSettings(num_draft_tokens=4, draft_model=tiny_draft[0], draft_tokenizer=tiny_draft[1]))
    state = open_sequence(model, tokenizer.encode(REPEATING), eos_ids=[], detokenizer=None, sampling=sampling,
                          max_tokens=60, speculative=speculative)
    logits = prefill(model, mx.array(state.tokens), state.cache)
    state.record(int(state.choose(logits)[0].item()))
    rounds = 0
    while state.room > 5 and rounds < 6:
        state.settle()
        with counting_syncs(monkeypatch) as syncs:
            proposed = state.propose()
            if proposed is None:  # a plain step
                state.record(int(state.choose(model.last_logits(mx.array([[state.last_token]]), state.cache))[0].item()))
                continue
            inputs = mx.concatenate([mx.array([state.last_token]), proposed])[None]  # (1, k + 1)
            target = model(inputs, state.cache)[0]  # (k + 1, vocab)
            tokens, logprobs = state.verify(target)
        # before: one item() per draft and per verified token; then (a draft model) one read of
        # its proposals and one of the verification; a draft's round with penalties: two reads
        assert syncs == ["tolist"], syncs
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


@pytest.mark.parametrize("sampling", [GREEDY_PENALIZED, SamplingSettings(repetition_penalty=1.5)],
                         ids=["rep+presence+frequency", "repetition"])
def test_draft_rounds_with_penalties_equal_plain_decoding(tiny_byte_llama, tiny_draft, sampling):
    """Greedy with penalties: a draft model's rounds (their proposals penalised on the device as
    each verification row's pending history) give plain decoding's tokens; a round whose rows
    ignored the proposals in the history would pick tokens the penalties forbid."""
    model, tokenizer = tiny_byte_llama
    prompt = tokenizer.encode(REPEATING)
    plain = [r.token for r in stream_generate(model, tokenizer, prompt, 30, sampling=sampling)]
    settings = SpeculativeSettings(num_draft_tokens=4, draft_model=model, draft_tokenizer=tokenizer)  # self-draft
    fast = list(stream_generate(model, tokenizer, prompt, 30, sampling=sampling, speculative=settings))
    assert [r.token for r in fast] == plain and fast[-1].accepted_tokens > 0
    other = SpeculativeSettings(num_draft_tokens=4, draft_model=tiny_draft[0], draft_tokenizer=tiny_draft[1])
    assert [r.token for r in stream_generate(model, tokenizer, prompt, 30, sampling=sampling, speculative=other)] == plain


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


ENGINE_PROMPTS = ["hello world", "once upon a time", "good morning", "lorem ipsum"]  # none reaches EOS in 16
ENGINE_SAMPLINGS = {
    "greedy": (SamplingSettings(), None),
    "sampled+logprobs": (SamplingSettings(temp=0.8, top_p=0.9, seed=5, repetition_penalty=1.1), 3),
    "penalized": (GREEDY_PENALIZED, None),
    "sampled+penalized": (SamplingSettings(temp=0.8, seed=7, presence_penalty=0.8, frequency_penalty=0.4), 2),
}


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("mode", list(ENGINE_SAMPLINGS))
def test_one_sync_per_engine_step(tiny_byte_llama, batch, mode, monkeypatch):
    """Every engine step that only decodes reads its rows' tokens (and logprobs) in one host
    sync, and overlaps: it reads the last step's tokens after its own graph, fed those tokens
    from the device, is queued (``mx.async_eval``); the tokens equal ``stream_generate`` alone
    (the reference for each row; the penalties count the token in flight)."""
    model, tokenizer = tiny_byte_llama
    sampling, logprobs = ENGINE_SAMPLINGS[mode]
    prompts = ENGINE_PROMPTS[:batch]
    expected = [[r.token for r in stream_generate(model, tokenizer, p, 16, sampling=sampling)] for p in prompts]
    engine = Engine(model, tokenizer, max_batch=4, prefix_cache_bytes=0)
    steps: list[tuple[int, list[str]]] = []  # (decode rows of a step without prompt chunks, its syncs)
    real_step, real_run = engine.step, engine._run
    planned: list[Step] = []
    monkeypatch.setattr(engine, "_run", lambda step: (planned.append(step), real_run(step))[1])
    queued: list[mx.array] = []  # every array given to mx.async_eval
    overlapped: list[bool] = []  # per read: the next step's tokens were queued before it
    real_emit = engine.delivery.emit

    def emit(picked) -> None:
        pipeline = engine.delivery.pipeline
        ahead = pipeline is not None and all(any(a is p.tokens for a in queued) for p in pipeline.picked)
        overlapped.append(ahead)
        real_emit(picked)

    def step() -> None:
        start = len(syncs)
        planned.clear()
        overlapped.clear()
        real_step()
        rows = len(planned[0].decode) if len(planned) == 1 and not planned[0].prefill else 0
        steps.append((rows, syncs[start:], list(overlapped)))

    with counting_syncs(monkeypatch) as syncs:
        real_async_eval = mx.async_eval
        monkeypatch.setattr(mx, "async_eval", lambda *a: (queued.extend(a[0] if isinstance(a[0], list) else a),
                                                          real_async_eval(*a))[1])
        monkeypatch.setattr(engine.delivery, "emit", emit)
        monkeypatch.setattr(engine, "step", step)
        with engine:
            with engine._wake:  # together: the idle loop sees them in one step
                handles = [engine.submit(GenerationRequest(tokenizer.encode(p), max_tokens=16, sampling=sampling,
                                                           logprobs=logprobs)) for p in prompts]
            events = [list(h) for h in handles]
    assert [[e.token for e in ev] for ev in events] == expected
    if logprobs is not None:
        assert all(e.logprob is not None and len(e.top_logprobs) == logprobs for ev in events for e in ev)
    assert sum(rows == batch for rows, _, _ in steps) >= 5, steps
    decoding = [(s, o) for rows, s, o in steps if rows]
    # the first decode step after the prompt's (which read the first token) has nothing to read yet
    assert decoding[0] == ([], []) and all(d == (["tolist"], [True]) for d in decoding[1:]), decoding


def test_tensor_parallel_step_is_one_sync_and_one_watchdog_countdown(tmp_path, monkeypatch):
    """Tensor parallel over a group of one (every ``all_sum`` is real but returns at once):
    each decode step is one host read and one watchdog countdown (before: two evals per summed
    projection, 4 per layer), and the tokens equal the plain model's."""
    from mlxformer.distributed.runner import DistributedModel, stream_distributed
    from mlxformer.distributed.tensor import RankSummed, load_tensor_shard
    from mlxformer.distributed.watchdog import Watchdog
    from mlxformer.formats.checkpoint import open_checkpoint
    from mlxformer.loader import load_tokenizer

    directory = write_tiny_byte_llama(tmp_path)
    plain, tokenizer = load(directory, dtype=mx.float32)
    expected = [r.token for r in stream_generate(plain, tokenizer, "hello world", 8)]
    reader = open_checkpoint(directory)
    group = mx.distributed.init()
    model = load_tensor_shard(reader, group, mx.float32)
    assert isinstance(model.layers[0].mlp.down_proj, RankSummed)
    watchdog = Watchdog(0, timeout=600)
    dist = DistributedModel(group, "tensor", model, load_tokenizer(reader), watchdog)
    arms: list[str] = []
    real_arm = watchdog.arm
    monkeypatch.setattr(watchdog, "arm", lambda what, timeout=None: (arms.append(what), real_arm(what, timeout))[1])
    per_token = []
    with counting_syncs(monkeypatch) as syncs:
        responses = stream_distributed(dist, tokenizer.encode("hello world"), 8, sampling=SamplingSettings(seed=0))
        tokens = []
        for response in responses:
            per_token.append((list(syncs), len(arms)))
            syncs.clear()
            arms.clear()
            tokens.append(response.token)
    assert tokens == expected
    assert all(s == ["item"] and n == 1 for s, n in per_token[1:]), per_token  # decode steps
