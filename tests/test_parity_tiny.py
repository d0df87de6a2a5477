"""Parity with transformers on tiny random checkpoints written by transformers' ``save_pretrained``.

Every family/feature combination is read back through mlxformer's own loading path
(``read_checkpoint`` + ``build_model``) and compared in float32 against the transformers
model that wrote it: full forward, prefill + token-by-token decode through the KV cache,
and chunked prefill, with plain and with stream-sharded projections.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch

from conftest import cpu_default_device, edit_config, log_softmax, max_diff, write_tiny_checkpoint
from mlxformer.cache import make_cache
from mlxformer.errors import MlxformerError
from mlxformer.generation.stream import decode_step, prefill
from mlxformer.loader import build_model, read_checkpoint
from mlxformer.models.row_sharding import apply_thread_policy

SEQ_LEN = 64
PREFILL_LEN = 40
# Both sides compute the same fp32 math; only summation order differs (measured <= 3e-5 with the
# O(1)-scale perturbed weights of conftest.perturb_). 1e-4 is far below what any wrong rope, bias,
# norm or window does: dropping Mistral's window or Qwen2's biases moves log-probs by 6-8.
BOUND = 1e-4

LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 1000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
}
# name -> (model_type, transformers config overrides)
CASES = {
    "llama-llama3-rope": ("llama", dict(rope_parameters=LLAMA3_ROPE, max_position_embeddings=128)),
    "llama-tied-head_dim32": ("llama", dict(tie_word_embeddings=True, head_dim=32)),
    "llama-attention-bias": ("llama", dict(attention_bias=True)),
    "mistral-sliding16": ("mistral", dict(sliding_window=16, rope_parameters={"rope_type": "default", "rope_theta": 5e4})),
    "qwen2-bias": ("qwen2", dict(rope_parameters={"rope_type": "default", "rope_theta": 5e4})),
    "qwen3-qk-norm": ("qwen3", dict(head_dim=32)),
    "llama-linear-rope": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0})),
}
# Classic (transformers 4) spellings of the same rope settings: top-level rope_theta + rope_scaling.
CLASSIC = {
    "llama-llama3-rope": dict(
        rope_theta=1000.0,
        rope_scaling={k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"},
    ),
    "qwen2-bias": dict(rope_theta=5e4, rope_scaling=None),
}


def hf_logits(hf_model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor(ids[None], dtype=torch.long)).logits[0].float().numpy()


def tokens(n: int = SEQ_LEN, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n)


def load_ours(directory, threads: int = 1):
    config, weights, metadata = read_checkpoint(directory)
    assert metadata is None
    model = build_model(config, weights)
    model.set_dtype(mx.float32)
    apply_thread_policy(model, threads)
    return model


@pytest.fixture(scope="module", autouse=True)
def cpu_device():
    """The sharded cases split projections over CPU streams, a CPU-only policy: pin the CPU."""
    with cpu_default_device():
        yield


# Every case runs plain (1) and with each projection split over 3 CPU streams (uneven shards).
THREADS = (1, 3)


@pytest.fixture(scope="module", params=[
    (name, threads) for name in list(CASES) + [f"{name}-classic" for name in CLASSIC] for threads in THREADS
], ids=lambda p: f"{p[0]}-threads{p[1]}")
def case(request, tmp_path_factory):
    """(our model, transformers model) for one checkpoint and thread count."""
    param, threads = request.param
    name = param.removesuffix("-classic")
    model_type, overrides = CASES[name]
    directory, hf_model = write_tiny_checkpoint(tmp_path_factory.mktemp(param), model_type, **overrides)
    if param.endswith("-classic"):
        original = hf_model.config.rope_parameters
        edit_config(directory, rope_parameters=None, **CLASSIC[name])
        written = json.loads((directory / "config.json").read_text())
        assert "rope_parameters" not in written and written["rope_theta"] == original["rope_theta"]
        # transformers itself reads the classic form back to the same rope settings.
        from transformers import AutoConfig

        assert AutoConfig.from_pretrained(directory).rope_parameters == original
    return load_ours(directory, threads), hf_model


def test_biases_and_norms_are_nontrivial(case):
    """Guard the fixture: transformers inits biases to 0 and norms to 1; ours were perturbed."""
    _, hf_model = case
    for name, param in hf_model.named_parameters():
        if name.endswith(".bias") or "norm" in name:
            assert float(param.detach().std()) > 0.1, name


def test_full_forward(case):
    ours, hf_model = case
    ids = tokens()
    ref = hf_logits(hf_model, ids)
    got = np.array(ours(mx.array(ids[None]))[0])
    assert got.shape == ref.shape == (SEQ_LEN, 256)
    assert max_diff(got, ref) <= BOUND
    # The bound is meaningful: the next-token distributions are far from uniform.
    assert float(log_softmax(ref).max(-1).mean()) > np.log(1 / 256) + 1.0


def test_prefill_then_decode_matches_full_forward(case):
    ours, hf_model = case
    ids = tokens(seed=2)
    ref = hf_logits(hf_model, ids)
    cache = make_cache(ours)
    first = prefill(ours, mx.array(ids[:PREFILL_LEN]), cache, step_size=PREFILL_LEN)
    steps = [np.array(first[0])]
    for t in range(PREFILL_LEN, SEQ_LEN):
        steps.append(np.array(decode_step(ours, mx.array(ids[t : t + 1]), cache)[0]))
    got = np.stack(steps)  # predictions for positions PREFILL_LEN-1 .. SEQ_LEN-1
    assert cache[0].offset == SEQ_LEN
    assert max_diff(got, ref[PREFILL_LEN - 1 :]) <= BOUND


@pytest.mark.parametrize("step_size", [7, 16])
def test_chunked_prefill_last_logits(case, step_size):
    ours, hf_model = case
    ids = tokens(seed=3)
    ref = hf_logits(hf_model, ids)
    last = prefill(ours, mx.array(ids), make_cache(ours), step_size=step_size)
    assert last.shape == (1, 256)
    assert max_diff(np.array(last[0]), ref[-1]) <= BOUND


def test_dynamic_rope_full_forward(tmp_path):
    # Dynamic NTK: transformers' full forward uses one base for the whole sequence (64 > 32 trained).
    directory, hf_model = write_tiny_checkpoint(
        tmp_path, "llama", max_position_embeddings=32,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
    )
    ids = tokens(seed=4)
    got = np.array(load_ours(directory)(mx.array(ids[None]))[0])
    assert max_diff(got, hf_logits(hf_model, ids)) <= BOUND


def test_dynamic_rope_chunked_prefill_and_decode(tmp_path):
    """Dynamic NTK with a prompt (64) past the trained length (32) prefilled in 16-token chunks:
    every chunk is rotated with the base of the whole prompt, as transformers' one forward pass
    does; the next token then matches transformers' cached decode step."""
    directory, hf_model = write_tiny_checkpoint(
        tmp_path, "llama", max_position_embeddings=32,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
    )
    ids = tokens(seed=5)
    ours = load_ours(directory)
    cache = make_cache(ours)
    last = np.array(prefill(ours, mx.array(ids), cache, step_size=16)[0])
    with torch.no_grad():
        out = hf_model(torch.tensor(ids[None]), use_cache=True)
        step = hf_model(torch.tensor([[7]]), past_key_values=out.past_key_values, use_cache=True)
    assert max_diff(last, out.logits[0, -1].float().numpy()) <= BOUND
    got = np.array(decode_step(ours, mx.array([7]), cache)[0])
    assert max_diff(got, step.logits[0, -1].float().numpy()) <= BOUND


def test_wrong_rope_setting_is_detected(tmp_path):
    """The comparison can fail: the same weights with the llama3 scaling dropped disagree."""
    directory, hf_model = write_tiny_checkpoint(
        tmp_path, "llama", rope_parameters=LLAMA3_ROPE, max_position_embeddings=128
    )
    edit_config(directory, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    ids = tokens()
    got = np.array(load_ours(directory)(mx.array(ids[None]))[0])
    assert max_diff(got, hf_logits(hf_model, ids)) > 100 * BOUND


def test_unsupported_rope_type_is_named(tmp_path):
    directory, _ = write_tiny_checkpoint(tmp_path, "llama")
    edit_config(directory, rope_parameters={"rope_type": "quadratic", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(MlxformerError, match="quadratic"):
        read_checkpoint(directory)
    edit_config(directory, rope_parameters=None, rope_theta=1e4, rope_scaling={"type": "mrope", "factor": 4.0})
    with pytest.raises(MlxformerError, match="mrope"):
        read_checkpoint(directory)


def test_unsupported_model_type_is_named(tmp_path):
    directory, _ = write_tiny_checkpoint(tmp_path, "llama")
    edit_config(directory, model_type="gpt_neox")
    with pytest.raises(MlxformerError, match="gpt_neox"):
        read_checkpoint(directory)
