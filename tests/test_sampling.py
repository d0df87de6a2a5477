"""Sampling filters, repetition penalty and stop strings against known answers, numpy
re-implementations, mlx-lm and transformers; and how ``stream_generate`` ends (eos, stop
string, max tokens) and reproduces with a seed."""

from __future__ import annotations

import copy
import random

import mlx.core as mx
import numpy as np
import pytest

from conftest import write_tiny_checkpoint
from mlxformer import generate, load, stream_generate
from mlxformer.sampling.options import SamplingSettings
from mlxformer.sampling.samplers import (
    greedy, keep_min_p, keep_top_k, keep_top_p, make_logits_processors, make_sampler,
    repetition_penalty_processor, sampling_logits,
)
from mlxformer.text.stop import StopMatcher

NEG_INF = -np.inf


def random_logprobs(rows: int = 4, vocab: int = 50, seed: int = 0) -> np.ndarray:
    logits = np.random.default_rng(seed).normal(scale=2.0, size=(rows, vocab)).astype(np.float32)
    return logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True)).astype(np.float32)


def kept(filtered: mx.array) -> np.ndarray:
    return np.isfinite(np.array(filtered))


# ---------------------------------------------------------------- filters


def test_greedy_is_argmax():
    lp = random_logprobs()
    assert np.array(greedy(mx.array(lp))).tolist() == lp.argmax(-1).tolist()
    assert make_sampler(0.0) is greedy


def test_top_p_known_answer():
    lp = mx.log(mx.array([[0.15, 0.5, 0.05, 0.3]]))
    assert kept(keep_top_p(lp, 0.45)).tolist() == [[False, True, False, False]]
    assert kept(keep_top_p(lp, 0.75)).tolist() == [[False, True, False, True]]
    assert kept(keep_top_p(lp, 0.85)).tolist() == [[True, True, False, True]]
    assert kept(keep_top_p(lp, 1.0)).all()


def test_top_k_min_p_known_answers():
    lp = mx.log(mx.array([[0.15, 0.5, 0.05, 0.3]]))
    assert kept(keep_top_k(lp, 2)).tolist() == [[False, True, False, True]]
    assert kept(keep_top_k(lp, 0)).all() and kept(keep_top_k(lp, 4)).all()
    # min_p 0.25: keep p >= 0.125
    assert kept(keep_min_p(lp, 0.25)).tolist() == [[True, True, False, True]]
    assert kept(keep_min_p(lp, 0.7)).tolist() == [[False, True, False, False]]


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_matches_numpy_and_mlx_lm(top_p):
    from mlx_lm.sample_utils import apply_top_p

    lp = random_logprobs(seed=1)
    probs = np.exp(lp.astype(np.float64))
    expected = np.zeros_like(lp, dtype=bool)
    for r in range(lp.shape[0]):
        order = np.argsort(-probs[r])
        mass_above = np.concatenate([[0.0], np.cumsum(probs[r][order])[:-1]])
        expected[r, order[mass_above < top_p]] = True
    got = np.array(keep_top_p(mx.array(lp), top_p))
    assert (np.isfinite(got) == expected).all()
    assert np.array_equal(got[expected], lp[expected])  # kept log-probs are untouched
    assert (np.isfinite(np.array(apply_top_p(mx.array(lp), top_p))) == expected).all()


@pytest.mark.parametrize("k", [1, 5, 49])
def test_top_k_matches_numpy(k):
    lp = random_logprobs(seed=2)
    expected = lp >= np.sort(lp, axis=-1)[:, -k][:, None]
    got = np.array(keep_top_k(mx.array(lp), k))
    assert (np.isfinite(got) == expected).all() and np.array_equal(got[expected], lp[expected])


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5])
def test_min_p_matches_numpy(min_p):
    lp = random_logprobs(seed=3)
    probs = np.exp(lp.astype(np.float64))
    expected = probs >= min_p * probs.max(-1, keepdims=True)
    assert (kept(keep_min_p(mx.array(lp), min_p)) == expected).all()


def test_make_sampler_rejects_bad_settings():
    for bad in (dict(temp=-1.0), dict(temp=1.0, top_p=0.0), dict(temp=1.0, top_p=1.5),
                dict(temp=1.0, top_k=-1), dict(temp=1.0, min_p=1.0)):
        with pytest.raises(ValueError):
            make_sampler(**bad)


def test_sampling_distribution():
    """Frequencies of 20000 draws match softmax(logits / temp) restricted to the top-k."""
    probs = np.array([0.4, 0.25, 0.2, 0.1, 0.05])
    n = 20000
    lp = mx.broadcast_to(mx.log(mx.array(probs, mx.float32)), (n, 5))
    mx.random.seed(0)
    draws = np.array(make_sampler(temp=0.7, top_k=3)(lp))
    target = probs[:3] ** (1 / 0.7)
    target = np.concatenate([target / target.sum(), [0.0, 0.0]])
    freq = np.bincount(draws, minlength=5) / n
    assert np.abs(freq - target).max() < 0.015  # ~4 standard deviations
    # temp 1, top_p 0.6: only the two tokens with mass above < 0.6 survive, renormalised.
    draws = np.array(make_sampler(temp=1.0, top_p=0.6)(lp))
    freq = np.bincount(draws, minlength=5) / n
    assert np.abs(freq - np.array([0.4, 0.25, 0, 0, 0]) / 0.65).max() < 0.015


def transformers_distribution(logits: np.ndarray, temp: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """softmax of transformers' TopK -> TopP -> MinP warpers, then the temperature (llama.cpp's
    order, which is ours: the filters see the untempered distribution)."""
    import torch
    from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = torch.tensor(logits, dtype=torch.float64)
    ids = torch.zeros((scores.shape[0], 1), dtype=torch.long)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(ids, scores)
    return torch.softmax(scores / temp, dim=-1).numpy()


def flat_logprobs(vocab: int = 50) -> np.ndarray:
    return np.full((1, vocab), -np.log(vocab), dtype=np.float32)


@pytest.mark.parametrize(
    "logprobs, temp, top_k, top_p, min_p",
    [
        # The review's case, nearly flat (top-5 mass ~0.1 <= 1 - p). Exactly flat logits are
        # not compared: transformers' top-k keeps every token tied with the k-th (here all 50).
        (flat_logprobs() + np.random.default_rng(7).normal(scale=1e-3, size=(1, 50)).astype(np.float32),
         0.8, 5, 0.9, 0.0),
        (random_logprobs(seed=4), 0.8, 5, 0.9, 0.0),
        (random_logprobs(seed=5), 1.0, 10, 0.5, 0.0),
        (random_logprobs(seed=6), 0.7, 20, 0.8, 0.1),
        (random_logprobs(seed=8), 1.3, 3, 0.95, 0.3),
    ],
)
def test_combined_filters_match_transformers_warpers(logprobs, temp, top_k, top_p, min_p):
    """The distribution the sampler draws from (kept tokens and their renormalised
    probabilities) equals transformers' warpers composed in the same order."""
    got = np.array(mx.softmax(sampling_logits(mx.array(logprobs), temp, top_p, top_k, min_p), axis=-1))
    want = transformers_distribution(logprobs, temp, top_k, top_p, min_p)
    assert ((got > 0) == (want > 0)).all()
    assert np.allclose(got, want, atol=1e-5)


def test_top_k_then_top_p_on_a_flat_distribution_draws_from_the_top_k():
    """temp .8, top-k 5, top-p .9 on 50 equally likely tokens (llama.cpp keeps exactly k on
    ties): 5 tokens of probability .2 each, and every draw is one of them."""
    probs = np.array(mx.softmax(sampling_logits(mx.array(flat_logprobs()), 0.8, 0.9, 5), axis=-1))[0]
    assert np.allclose(np.sort(probs)[-5:], 0.2) and np.count_nonzero(probs) == 5
    lp = mx.broadcast_to(mx.array(flat_logprobs()), (2000, 50))
    kept_ids = set(np.nonzero(np.isfinite(np.array(keep_top_k(lp[:1], 5))[0]))[0].tolist())
    mx.random.seed(0)
    draws = np.array(make_sampler(temp=0.8, top_k=5, top_p=0.9)(lp))
    assert set(draws.tolist()) == kept_ids and len(kept_ids) == 5


# ---------------------------------------------------------------- repetition penalty


def test_repetition_penalty_known_answer():
    logits = mx.array([[2.0, -2.0, 1.0, 0.5]])
    out = repetition_penalty_processor(2.0)(mx.array([0, 1, 0]), logits)
    assert np.allclose(np.array(out), [[1.0, -4.0, 1.0, 0.5]])
    assert make_logits_processors(SamplingSettings()) == []
    assert make_logits_processors(SamplingSettings(repetition_penalty=1.0)) == []
    with pytest.raises(ValueError):
        repetition_penalty_processor(0.0)


def test_repetition_penalty_matches_transformers():
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(4)
    logits = rng.normal(size=(1, 300)).astype(np.float32)
    history = rng.integers(0, 300, size=100)
    (ours,) = make_logits_processors(SamplingSettings(repetition_penalty=1.3))
    got = np.array(ours(mx.array(history), mx.array(logits)))
    # ours looks only at the last 64 tokens (llama.cpp's repeat_last_n); transformers at what it is given
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor(history[None, -64:]), torch.tensor(logits)).numpy()
    assert np.allclose(got, ref, atol=1e-6)
    old_only = set(history[:-64].tolist()) - set(history[-64:].tolist())
    assert old_only and all(got[0, t] == logits[0, t] for t in old_only)


# ---------------------------------------------------------------- stop strings


def test_stop_matcher_known_answers():
    m = StopMatcher(["</s>"])
    assert m.feed("Hello <") == ("Hello ", False)  # "<" could start the stop string: held back
    assert m.feed("/") == ("", False)
    assert m.feed("s>world") == ("", True)
    m = StopMatcher(["ab", "xyz"])
    assert m.feed("1 a") == ("1 ", False)
    assert m.feed("c x") == ("ac ", False)
    assert m.feed("y") == ("", False)
    assert m.flush() == "xy"
    m = StopMatcher(["", "D", "END"])  # the earliest match wins, not the first listed; "" is ignored
    assert m.feed("xxENDyy") == ("xx", True)
    assert StopMatcher([]).feed("a</s>") == ("a</s>", False)


def test_stop_matcher_random_splits():
    rng = random.Random(5)
    for _ in range(300):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("abc ") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        m, out, stopped = StopMatcher(stops), "", False
        for piece in pieces:
            emitted, stopped = m.feed(piece)
            out += emitted
            if stopped:
                break
        if not stopped:
            out += m.flush()
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        assert out == (text[: min(hits)] if hits else text), (text, stops, pieces)
        assert stopped == bool(hits)


# ---------------------------------------------------------------- stream_generate endings


@pytest.fixture(scope="module")
def tiny_lm(smollm, tmp_path_factory):
    """A tiny random Llama over SmolLM2's 49152-token vocabulary, with SmolLM2's tokenizer, via ``load``."""
    directory, _ = write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_lm"), "llama", vocab_size=49152, tie_word_embeddings=True
    )
    smollm[1].save(directory)
    return load(directory)


PROMPT = "Once upon a time, in a land far away,"


@pytest.fixture(scope="module")
def greedy_run(tiny_lm):
    model, tokenizer = tiny_lm
    responses = list(stream_generate(model, tokenizer, PROMPT, 24, temp=0.0))
    return [r.token for r in responses], responses


def test_max_tokens(tiny_lm, greedy_run):
    model, tokenizer = tiny_lm
    tokens, responses = greedy_run
    assert len(responses) == 24 and not set(tokens) & set(tokenizer.eos_token_ids)
    assert [r.finish_reason for r in responses] == [None] * 23 + ["length"]
    assert "".join(r.text for r in responses) == tokenizer.decode(tokens)
    assert responses[-1].prompt_tokens == len(tokenizer.encode(PROMPT))
    assert responses[-1].generation_tokens == 24
    short = list(stream_generate(model, tokenizer, PROMPT, 5, temp=0.0))
    assert [r.token for r in short] == tokens[:5] and short[-1].finish_reason == "length"


def test_stops_on_eos(tiny_lm, greedy_run):
    model, tokenizer = tiny_lm
    tokens, _ = greedy_run
    k = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    eos_tokenizer = copy.copy(tokenizer)
    eos_tokenizer.eos_token_ids = [tokens[k]]
    responses = list(stream_generate(model, eos_tokenizer, PROMPT, 24, temp=0.0))
    assert [r.token for r in responses] == tokens[: k + 1]
    assert responses[-1].finish_reason == "stop"
    assert "".join(r.text for r in responses) == tokenizer.decode(tokens[:k])  # eos text not emitted


def test_stops_on_stop_string(tiny_lm, greedy_run):
    model, tokenizer = tiny_lm
    _, responses = greedy_run
    text = "".join(r.text for r in responses)
    boundary = len("".join(r.text for r in responses[:6]))
    stop = text[boundary - 2 : boundary + 2]  # spans a token boundary
    assert len(stop) == 4
    out = list(stream_generate(model, tokenizer, PROMPT, 24, temp=0.0, stop=[stop]))
    assert out[-1].finish_reason == "stop" and len(out) <= 7
    assert "".join(r.text for r in out) == text[: text.find(stop)]
    assert generate(model, tokenizer, PROMPT, 24, temp=0.0, stop=[stop]) == text[: text.find(stop)]


def test_seed_reproducibility(tiny_lm):
    model, tokenizer = tiny_lm

    def sample(seed: int) -> list[int]:
        return [r.token for r in stream_generate(model, tokenizer, PROMPT, 12, temp=1.0, seed=seed)]

    first = sample(11)
    assert sample(11) == first
    assert sample(12) != first
    text = generate(model, tokenizer, PROMPT, 12, temp=1.0, seed=11)
    assert text == tokenizer.decode(first)


def test_sampled_ids_past_the_tokenizer_stream_as_empty_text(smollm, tmp_path):
    """A model whose embedding has padding rows past the tokenizer's last id (Qwen2.5), made to
    pick them: the stream goes on to max_tokens with "" for those ids, as transformers decodes them."""
    from safetensors.numpy import load_file, save_file
    from transformers import AutoTokenizer

    tokenizer = smollm[1]
    n = tokenizer.vocab_size
    directory, _ = write_tiny_checkpoint(tmp_path, "llama", vocab_size=n + 64, tie_word_embeddings=False)
    tokenizer.save(directory)
    weights = load_file(directory / "model.safetensors")
    # The final norm keeps one hidden unit; only two padding rows of lm_head read it, with
    # opposite signs: whatever the hidden state, greedy decoding picks a padding id.
    weights["model.norm.weight"] = np.eye(1, weights["model.norm.weight"].shape[0], dtype=np.float32)[0]
    head = np.zeros_like(weights["lm_head.weight"])
    head[n + 5, 0], head[n + 6, 0] = 10.0, -10.0
    weights["lm_head.weight"] = head
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    model, tokenizer = load(directory)
    responses = list(stream_generate(model, tokenizer, PROMPT, 6, temp=0.0))
    tokens = [r.token for r in responses]
    assert len(tokens) == 6 and all(t in (n + 5, n + 6) for t in tokens)
    assert responses[-1].finish_reason == "length"
    reference = AutoTokenizer.from_pretrained(str(directory))
    assert "".join(r.text for r in responses) == reference.decode(tokens) == ""
