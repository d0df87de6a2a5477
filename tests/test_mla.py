"""GLM-4.5/4.6 (``glm4_moe``) and the multi-head latent attention families (DeepSeek-V2/V3,
GLM-4.7-Flash = ``glm4_moe_lite``) on tiny random checkpoints written by transformers' own config
classes (odd sizes; the routers' ``e_score_correction_bias`` randomised), against transformers'
eager logits; engine batch and speculative greedy identity; the latent cache's bytes.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from conftest import cpu_default_device, max_diff, write_byte_tokenizer, write_tiny_checkpoint
from mlxformer import load, stream_generate
from mlxformer.cache import CacheSettings, make_cache
from mlxformer.engine import batch_generate
from mlxformer.generation import decode_step, prefill
from mlxformer.models.moe import SparseMoE
from mlxformer.speculative import SpeculativeSettings

BOUND = 3e-4  # fp32 on both sides
_ROUTED = dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, first_k_dense_replace=1,
               n_shared_experts=1, num_hidden_layers=3)
_MLA = dict(kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=24, v_head_dim=20, num_attention_heads=5,
            num_key_value_heads=5, hidden_size=80)
CASES = {
    # grouped sigmoid routing with a correction bias, q/k norm, q/k/v biases, half the head rotated
    "glm4_moe": dict(_ROUTED, n_group=4, topk_group=2, head_dim=16, use_qk_norm=True, attention_bias=True,
                     routed_scaling_factor=2.5),
}


def tokens(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 256, size=n)


@pytest.fixture(scope="module", autouse=True)
def cpu_device():
    with cpu_default_device():
        yield


def write_family(directory, model_type, **overrides):
    """A tiny checkpoint of ``model_type`` with a random ``e_score_correction_bias`` (transformers
    initialises the buffer to zeros, which would hide a router ignoring it) and the byte tokenizer."""
    directory, hf_model = write_tiny_checkpoint(directory, model_type, **{**CASES[model_type], **overrides})
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, buffer in hf_model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))
    hf_model.save_pretrained(directory)
    write_byte_tokenizer(directory)
    return directory, hf_model


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    directory, hf_model = write_family(tmp_path_factory.mktemp(request.param), request.param)
    model, tokenizer = load(directory, dtype=mx.float32)
    tokenizer.eos_token_ids = []
    return request.param, directory, model, tokenizer, hf_model


def reference(hf_model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor(ids[None])).logits[0].numpy()


def test_forward(case):
    name, _, model, _, hf_model = case
    assert isinstance(model.layers[0].mlp, SparseMoE) is False and isinstance(model.layers[1].mlp, SparseMoE)
    for length in (80, 9):
        ids = tokens(length)
        assert max_diff(np.array(model(mx.array(ids[None]))[0]), reference(hf_model, ids)) <= BOUND, length


def test_chunked_prefill_then_decode(case):
    name, _, model, _, hf_model = case
    ids = tokens(40)
    ref = reference(hf_model, ids)
    cache = make_cache(model, CacheSettings())
    steps = [np.array(prefill(model, mx.array(ids[:20]), cache, step_size=7)[0])]
    for t in range(20, 40):
        steps.append(np.array(decode_step(model, mx.array(ids[t : t + 1]), cache)[0]))
    assert max_diff(np.stack(steps), ref[19:]) <= BOUND


PROMPTS = ["Once upon a time, in a land far away,", "abcabcabcabc", "The quick brown fox jumps over"]


def test_engine_batch_and_speculation_match_alone(case):
    name, _, model, tokenizer, _ = case
    alone = [[r.token for r in stream_generate(model, tokenizer, p, 12)] for p in PROMPTS]
    assert batch_generate(model, tokenizer, PROMPTS, 12, max_batch=3) == [tokenizer.decode(t) for t in alone]
    lookup = SpeculativeSettings(prompt_lookup=True, num_draft_tokens=4, ngram_min=1)
    responses = list(stream_generate(model, tokenizer, PROMPTS[1], 12, speculative=lookup))
    assert [r.token for r in responses] == alone[1]
