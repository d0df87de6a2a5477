"""A sliding-window model (Mistral) caches exactly its window: bounded memory, transformers' logits.

Reference: transformers' eager Mistral with ``sliding_window`` on the same tiny random
checkpoint, full forward over a prompt several windows long.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from conftest import write_tiny_checkpoint
from mlxformer.cache import CacheSettings, make_cache
from mlxformer.cache.rotating import RotatingKVCache
from mlxformer.generation.stream import decode_step, prefill
from mlxformer.loader import build_model, read_checkpoint

WINDOW = 8


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    directory, hf_model = write_tiny_checkpoint(
        tmp_path_factory.mktemp("mistral_window"), "mistral", sliding_window=WINDOW, head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )
    config, weights, _ = read_checkpoint(directory)
    model = build_model(config, weights)
    model.set_dtype(mx.float32)
    return model, hf_model


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))


@pytest.mark.parametrize("bits", [None, 8])
def test_sliding_window_cache_is_bounded_and_matches_transformers(mistral, bits):
    model, hf_model = mistral
    ids = np.random.default_rng(5).integers(0, 256, size=40)
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids[None])).logits[0].numpy()  # (40, V)
    # transformers really applies the window: without it the logits past the window differ
    with torch.no_grad():
        hf_model.config.sliding_window = None
        unwindowed = hf_model(torch.tensor(ids[None])).logits[0].numpy()
        hf_model.config.sliding_window = WINDOW
    assert np.abs(log_softmax(unwindowed[WINDOW:]) - log_softmax(ref[WINDOW:])).max() > 2.0

    cache = make_cache(model, CacheSettings(kv_bits=bits, kv_group_size=32))
    assert all(isinstance(c, RotatingKVCache) and c.max_size == WINDOW and c.keep == 0 for c in cache)
    steps = [np.array(prefill(model, mx.array(ids[:20]), cache, step_size=13)[0])]  # chunks 13 + 7 > window
    sizes = []
    for t in range(20, 40):
        steps.append(np.array(decode_step(model, mx.array(ids[t : t + 1]), cache)[0]))
        sizes.append(sum(c.nbytes for c in cache))
    got = np.stack(steps)  # predictions for positions 19..39
    assert cache[0].offset == 40 and cache[0].size == WINDOW
    # memory: exactly the window's keys and values, however long the sequence
    args = model.args
    if bits is None:
        assert set(sizes) == {2 * len(cache) * args.num_key_value_heads * WINDOW * args.head_dim * 4}
    else:
        assert len(set(sizes)) == 1
    # float: summation order only; 8-bit: the cache's rounding (a wrong window moves log-probs by > 2)
    bound = 1e-4 if bits is None else 0.3
    assert np.abs(log_softmax(got) - log_softmax(ref[19:])).max() <= bound


def test_smaller_max_kv_size_wins_over_the_window(mistral):
    model, _ = mistral
    small = make_cache(model, CacheSettings(max_kv_size=6, keep=2))
    assert (small[0].max_size, small[0].keep) == (6, 2)
    large = make_cache(model, CacheSettings(max_kv_size=100))
    assert (large[0].max_size, large[0].keep) == (WINDOW, 0)
