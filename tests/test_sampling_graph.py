"""The batch's sampling graph (``mlxformer.sampling.choosing``): its size does not grow with the rows, its
filters keep what a numpy float64 reference keeps on SmolLM2's real logits (float32 and
bfloat16), per-row penalties equal transformers' processors row by row, draws follow the
filtered distribution, and a seeded row draws the same token alone or in any batch."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxformer.sampling.choosing import ChoiceRow, choose, draw_key, process
from mlxformer.sampling.options import SamplingSettings
from mlxformer.sampling.samplers import keep_mask, normalize, top_logprobs
from test_batch_step import graph_ops

VOCAB = 256
KINDS = {
    "greedy": SamplingSettings(),
    "temperature": SamplingSettings(temp=1.0),
    "top_p": SamplingSettings(temp=0.7, top_p=0.9),
    "penalties": SamplingSettings(temp=0.8, top_k=40, repetition_penalty=1.2, presence_penalty=0.5,
                                  frequency_penalty=0.3, logit_bias={3: 2.0}),
}


def rows_of(settings: SamplingSettings, batch: int, mixed: bool = False) -> list[ChoiceRow]:
    """``batch`` rows with ragged histories (the odd ones greedy when ``mixed``)."""
    rows = []
    for i in range(batch):
        s = SamplingSettings() if mixed and i % 2 else settings
        rows.append(ChoiceRow(s, list(range(i, 2 * i + 20)), 10, draw_key(7, i) if not s.greedy else None))
    return rows


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("compiled", [True, False])
def test_sampling_graph_does_not_grow_with_the_batch(kind, compiled, tmp_path):
    """Before: 42 / 344 / 1,376 primitives at batch 1 / 8 / 32 for temperature 1 (one graph per row)."""
    counts = []
    if not compiled:
        mx.disable_compile()  # count the primitives inside the compiled filter too
    try:
        for batch in (1, 8, 32):
            logits = mx.random.normal((batch, VOCAB), key=mx.random.key(batch))
            mx.eval(logits)
            for mixed in (False, True):
                tokens, _ = choose(logits, rows_of(KINDS[kind], batch, mixed))
                counts.append(graph_ops(tokens, tmp_path / f"{batch}{mixed}.dot"))
    finally:
        mx.enable_compile()
    assert counts[0] >= 4, counts  # the graph was really walked
    # batch 1 may be a few ops smaller (broadcasts to the shape an array already has are elided)
    assert counts[0] <= counts[2] == counts[4] and counts[1] <= counts[3] == counts[5], counts
    assert counts[2] - counts[0] <= 8 and max(counts) <= 150, counts  # before: 1,376 at batch 32 for temperature 1


def reference_keep(logprobs: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """llama.cpp's filter order in float64 numpy: top-k (exactly k, ties by position), top-p over
    the renormalised mass (the first token always stays), min-p relative to the top token."""
    lp = logprobs.astype(np.float64)
    order = np.argsort(-lp, kind="stable")
    ranked = lp[order]
    keep = np.ones(lp.size, bool)
    if top_k:
        keep[top_k:] = False
    if top_p < 1.0:
        probs = np.where(keep, np.exp(ranked - ranked[keep].max()), 0.0)
        probs /= probs.sum()
        mass_above = np.cumsum(probs) - probs
        keep &= mass_above < top_p
        keep[0] = True
    if min_p:
        keep &= ranked >= ranked[0] + np.log(min_p)
    kept = np.zeros(lp.size, bool)
    kept[order[keep]] = True
    return kept


FILTERS = [(0, 0.95, 0.0), (0, 0.9, 0.0), (0, 0.5, 0.0), (40, 1.0, 0.0), (1, 1.0, 0.0), (0, 1.0, 0.05),
           (40, 0.9, 0.02), (200, 0.99, 0.01), (0, 1.0, 0.0)]


@pytest.fixture(scope="module")
def smollm_logits(smollm):
    """SmolLM2's real next-token logits (1, 49152) after a short prompt, float32."""
    model, tokenizer = smollm
    ids = tokenizer.encode("My favourite")  # an open continuation: thousands of plausible tokens
    logits = model.last_logits(mx.array([ids])).astype(mx.float32)
    mx.eval(logits)
    return logits


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_kept_sets_equal_the_float64_reference_on_real_logits(smollm_logits, dtype):
    """Every filter setting as one row of one batch; bfloat16 logits as a bfloat16 model's last
    projection gives them (accumulating in bfloat16, top-p 0.95 kept 20 tokens instead of 2,229)."""
    logits = mx.broadcast_to(smollm_logits.astype(dtype), (len(FILTERS), smollm_logits.shape[-1]))
    top_k, top_p, min_p = (mx.array(list(column)) for column in zip(*FILTERS))
    logprobs = normalize(logits)
    got = np.array(keep_mask(logprobs, top_k, top_p.astype(mx.float32), min_p.astype(mx.float32)))
    exact = np.array(logprobs[0]).astype(np.float64)  # (the reference renormalises in float64)
    sizes = []
    for row, (k, p, m) in enumerate(FILTERS):
        want = reference_keep(exact, k, p, m)
        assert (got[row] == want).all(), (k, p, m, got[row].sum(), want.sum())
        sizes.append(int(want.sum()))
    assert sizes[0] > 1000 and sizes[4] == 1 and sizes[-1] == exact.size, sizes  # the cases are not trivial
    if dtype == mx.bfloat16:  # the same filters accumulating in bfloat16 (no float32 cast) miss the reference
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        uncast = np.array(keep_mask(lp, top_k, top_p.astype(mx.float32), min_p.astype(mx.float32)))
        assert uncast[0].sum() != sizes[0]


def test_normalize_equals_a_float64_log_softmax(smollm_logits):
    """Log-probs within 2e-6 (plus the float32 spacing at their size) of numpy's float64
    log-softmax: SmolLM2's real logits (float32 and bfloat16), and random rows over vocabularies
    from 1 to Gemma's 262k (one not a block multiple). MLX's CPU ``mx.logsumexp`` over SmolLM2's
    49k is 1e-4 low (every log-prob that much high)."""
    from conftest import log_softmax

    rng = np.random.default_rng(0)
    cases = [smollm_logits, smollm_logits.astype(mx.bfloat16)] + [
        mx.array(rng.normal(0, 3, (3, vocab)).astype(np.float32)) for vocab in (1, 7, 256, 49153, 151936, 262144)]
    for logits in cases:
        exact = log_softmax(np.array(logits.astype(mx.float32)))
        error = np.abs(np.array(normalize(logits)) - exact) - np.spacing(np.abs(exact).astype(np.float32))
        assert error.max() < 2e-6, logits.shape
    if mx.default_device() == mx.cpu:  # the case is not trivial there
        plain = smollm_logits - mx.logsumexp(smollm_logits, axis=-1, keepdims=True)
        assert np.abs(np.array(plain) - log_softmax(np.array(smollm_logits))).max() > 2e-5


def test_batched_draws_follow_each_rows_filtered_distribution():
    """Rows with different settings in one batch: greedy rows give the argmax, the others draw
    (each with its own key) from softmax(filtered / temp)."""
    probs = np.array([0.4, 0.25, 0.2, 0.1, 0.05])
    settings = [SamplingSettings(temp=0.7, top_k=3), SamplingSettings(), SamplingSettings(temp=1.0, top_p=0.6)]
    n = 3000
    rows = [ChoiceRow(settings[i % 3], [0], 1, draw_key(11, i) if i % 3 != 1 else None) for i in range(3 * n)]
    logits = mx.broadcast_to(mx.log(mx.array(probs, mx.float32)), (3 * n, 5))
    tokens = np.array(choose(logits, rows)[0])
    topk = probs[:3] ** (1 / 0.7)
    targets = [np.concatenate([topk / topk.sum(), [0, 0]]), np.eye(5)[0], np.array([0.4, 0.25, 0, 0, 0]) / 0.65]
    for i, target in enumerate(targets):
        freq = np.bincount(tokens[i::3], minlength=5) / n
        assert np.abs(freq - target).max() < 0.03, (i, freq, target)  # ~3.5 standard deviations


def test_a_seeded_row_draws_the_same_alone_and_in_any_batch():
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(scale=3.0, size=(8, VOCAB)).astype(np.float32))
    settings = [SamplingSettings(temp=1.0, top_p=0.95, seed=s) for s in range(8)]
    rows = [ChoiceRow(s, [1, 2], 2, draw_key(s.seed, 3)) for s in settings]
    together = np.array(choose(logits, rows)[0]).tolist()
    alone = [np.array(choose(logits[i : i + 1], [rows[i]])[0]).item() for i in range(8)]
    reversed_ = np.array(choose(logits[::-1], rows[::-1])[0]).tolist()[::-1]
    assert together == alone == reversed_
    # another draw or another seed gives other tokens (the keys differ)
    other = [np.array(choose(logits[i : i + 1], [ChoiceRow(settings[i], [1], 1, draw_key(i, 4))])[0]).item() for i in range(8)]
    assert other != alone and len({draw_key(s, n) for s in range(8) for n in range(8)}) == 64


def test_penalties_per_row_equal_transformers_processors():
    """Each row's penalties (its own setting and history, or none) equal transformers' processors
    (repetition over the last 64 tokens) and OpenAI's presence/frequency formula, row by row."""
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(5)
    logits = rng.normal(size=(4, VOCAB)).astype(np.float32)
    histories = [rng.integers(0, VOCAB, size=n).tolist() for n in (100, 30, 5, 70)]
    settings = [SamplingSettings(repetition_penalty=1.3), SamplingSettings(),
                SamplingSettings(presence_penalty=0.5, frequency_penalty=0.7, logit_bias={7: 3.0, 9: -100.0}),
                SamplingSettings(repetition_penalty=0.8, frequency_penalty=-1.0)]
    prompt_lengths = [50, 10, 2, 40]
    got = np.array(process(mx.array(logits), [ChoiceRow(s, h, p) for s, h, p in zip(settings, histories, prompt_lengths)]))
    for row, (s, history, start) in enumerate(zip(settings, histories, prompt_lengths)):
        want = logits[row].astype(np.float64)
        if s.repetition_penalty:
            recent = torch.tensor([history[-64:]])
            want = RepetitionPenaltyLogitsProcessor(s.repetition_penalty)(recent, torch.tensor(want[None]))[0].numpy()
        counts = np.bincount(history[start:], minlength=VOCAB)
        want = want - s.frequency_penalty * counts - s.presence_penalty * (counts > 0)
        for token, bias in (s.logit_bias or {}).items():
            want[token] += bias
        assert np.allclose(got[row], want, atol=1e-5), row


def test_top_logprobs_by_partition_equal_a_full_sort():
    rng = np.random.default_rng(3)
    lp = rng.normal(size=(5, 1000)).astype(np.float32)
    for n in (1, 5, 20, 1000):
        ids, values = top_logprobs(mx.array(lp), n)
        want = np.argsort(-lp, axis=-1, kind="stable")[:, :n]
        assert np.array(ids).tolist() == want.tolist()
        assert np.array_equal(np.array(values), np.take_along_axis(lp, want, axis=-1))
