"""``SamplingSettings``: every value validated once, when the settings are made, each bad value
refused with an ``OptionError`` naming its field; the filters and processors it configures."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlxformer.errors import MlxformerError, OptionError
from mlxformer.sampling.options import MAX_SEED, SamplingSettings
from mlxformer.sampling.samplers import keep_top_p, make_sampler, repetition_penalty_processor

FLOAT_FIELDS = ["temp", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"]


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_every_float_rejects_nan_and_infinities(field, value):
    with pytest.raises(OptionError) as info:
        SamplingSettings(**{field: value})
    assert info.value.param == field and str(info.value).startswith(f"{field} must be a finite number")
    assert isinstance(info.value, MlxformerError)
    with pytest.raises(OptionError) as info:
        SamplingSettings(logit_bias={3: value})
    assert info.value.param == "logit_bias"


@pytest.mark.parametrize("field,value", [
    ("temp", -0.1), ("top_p", 0.0), ("top_p", 1.01), ("top_k", -1), ("top_k", 2**31), ("min_p", 1.0), ("repetition_penalty", 0.0),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.5), ("seed", -2), ("seed", MAX_SEED + 1), ("seed", 1.5),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {1: 101.0}),
])
def test_out_of_range_values_name_their_field(field, value):
    with pytest.raises(OptionError) as info:
        SamplingSettings(**{field: value})
    assert info.value.param == field


def test_seed_range_is_what_mlx_accepts_and_minus_one_draws_one():
    assert SamplingSettings(seed=MAX_SEED).seeded().seed == MAX_SEED
    mx.random.key(MAX_SEED)  # the largest seed is one MLX takes
    with pytest.raises((TypeError, OverflowError, ValueError)):
        mx.random.key(MAX_SEED + 1)
    drawn = {SamplingSettings(seed=-1, temp=1.0).seeded().seed for _ in range(4)}
    assert len(drawn) > 1 and all(0 <= s <= MAX_SEED for s in drawn)  # type: ignore[operator]


def test_logit_bias_ids_are_checked_against_the_vocabulary():
    settings = SamplingSettings(logit_bias={99: 1.0})
    settings.check_vocabulary(100)
    with pytest.raises(OptionError, match="outside the vocabulary"):
        settings.check_vocabulary(99)


@pytest.mark.parametrize("seed", range(6))
def test_top_p_always_keeps_the_most_likely_token(seed):
    """On a 49k vocabulary of close logits, ``1 - cumsum`` rounds above a tiny top-p for the top
    token too: nothing was kept and the draw was uniform. The top token must always survive."""
    logits = 0.1 * mx.random.normal((1, 49152), key=mx.random.key(seed))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    kept = np.isfinite(np.array(keep_top_p(logprobs, 1e-6)))[0]
    assert kept.sum() == 1 and kept[int(mx.argmax(logprobs).item())]
    draws = make_sampler(temp=1.0, top_p=1e-6)(mx.broadcast_to(logprobs, (64, 49152)))
    assert (np.array(draws) == int(mx.argmax(logprobs).item())).all()


def test_repetition_penalty_returns_a_new_array():
    logits = mx.array([[2.0, -2.0, 1.0, 0.5]])
    before = np.array(logits)
    out = repetition_penalty_processor(2.0)(mx.array([0, 1]), logits)
    assert np.array_equal(np.array(logits), before)
    assert np.allclose(np.array(out), [[1.0, -4.0, 1.0, 0.5]])


def test_a_temperature_or_top_p_too_small_for_float32_picks_the_most_likely_token():
    """Sampling's limit as temperature or top_p goes to 0 is the most likely token. Below about
    1e-37 a log-probability over the temperature overflowed float32 (1e-40 drew end-of-text
    tokens in the server); a top_p that float32 rounds to 0 (1e-46) kept no token."""
    from mlxformer.sampling.choosing import ChoiceRow, choose, draw_key

    logits = 0.1 * mx.random.normal((4, 49152), key=mx.random.key(3))  # flat: the top log-prob near -10
    best = np.array(mx.argmax(logits, axis=-1))
    cases = [dict(temp=t) for t in (1e-46, 1e-40, 1e-38, 1e-31, 1e-29)]
    cases += [dict(temp=1.0, top_p=p) for p in (1e-46, 1e-40)] + [dict(temp=1e-40, top_k=5, min_p=0.1)]
    for case in cases:
        settings = SamplingSettings(**case)
        rows = [ChoiceRow(settings, [1, 2], 2, draw_key(seed, 0)) for seed in range(4)]
        assert (np.array(choose(logits, rows)[0]) == best).all(), case
        sampler = make_sampler(**case)
        assert (np.array(sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))) == best).all(), case
