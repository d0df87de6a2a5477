"""gpt-oss in the one decoder: attention sinks, alternating sliding/full layers, biased q/k/v/o,
YaRN, and the biased top-k-softmax experts with the clamped SwiGLU, on a tiny random
checkpoint written by transformers' ``GptOssConfig`` (odd sizes; the window, 8, much shorter
than the 40-token prompt), against transformers' eager logits. The MXFP4 experts as the hub
stores them: tests/test_gpt_oss_mxfp4.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from family_checks import assert_batch_and_speculation_match_alone, chunked_then_decoded, tokens
from conftest import cpu_default_device, max_diff, write_byte_tokenizer, write_tiny_checkpoint
from mlxformer import load
from mlxformer.cache.kv import KVCache
from mlxformer.models.attention_ops import fused_attention, softcapped_attention
from mlxformer.models.moe_gpt_oss import TopKSoftmaxMoE

BOUND = 3e-4  # fp32 on both sides
SEQ_LEN, PREFILL_LEN = 40, 20
GPT_OSS = dict(
    num_local_experts=6, num_experts_per_tok=2, intermediate_size=96, head_dim=32, sliding_window=8,
    num_hidden_layers=3, max_position_embeddings=256,
    rope_parameters=dict(rope_type="yarn", rope_theta=1000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                         original_max_position_embeddings=32, truncate=False),
)


def write_gpt_oss(directory, **overrides):
    directory, hf_model = write_tiny_checkpoint(directory, "gpt_oss", **{**GPT_OSS, **overrides})
    write_byte_tokenizer(directory)
    return directory, hf_model


def reference(hf_model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor(ids[None])).logits[0].numpy()


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    with cpu_default_device():
        directory, hf_model = write_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))
        model, tokenizer = load(directory, dtype=mx.float32, threads=1)
        tokenizer.eos_token_ids = []
        yield directory, model, tokenizer, hf_model, reference(hf_model, tokens(SEQ_LEN))


def test_config_reads_the_switches(case):
    _, model, _, _, _ = case
    args = model.args
    assert args.layer_types == ("sliding", "full", "sliding") and args.sliding_window == 8
    assert args.attention_sinks and args.qkv_bias and args.o_proj_bias
    assert args.rope.type == "yarn" and not args.rope.truncate
    assert all(isinstance(layer.mlp, TopKSoftmaxMoE) for layer in model.layers)


def test_forward_matches_transformers(case):
    """One forward of 40 tokens (the expert-sorted gather) and of 10 (the unsorted one)."""
    _, model, _, hf_model, ref = case
    assert max_diff(np.array(model(mx.array(tokens(SEQ_LEN)[None]))[0]), ref) <= BOUND
    short = tokens(10, seed=2)
    assert max_diff(np.array(model(mx.array(short[None]))[0]), reference(hf_model, short)) <= BOUND


def test_each_switch_matters(case):
    """The comparison can fail: zeroing the sinks, or plain RoPE instead of YaRN, moves the logits."""
    import dataclasses

    from mlxformer.models.rope_config import RopeConfig
    from mlxformer.models.rope_variants import make_rope

    _, model, _, _, ref = case
    ids = mx.array(tokens(SEQ_LEN)[None])
    saved = [layer.self_attn.sinks for layer in model.layers]
    for layer in model.layers:
        layer.self_attn.sinks = mx.zeros_like(layer.self_attn.sinks)
    assert max_diff(np.array(model(ids)[0]), ref) > 100 * BOUND
    for layer, sinks in zip(model.layers, saved):
        layer.self_attn.sinks = sinks
    ropes = [layer.self_attn.rope for layer in model.layers]
    plain = dataclasses.replace(model.args.rope, type="default")
    assert isinstance(plain, RopeConfig)
    for layer in model.layers:
        layer.self_attn.rope = make_rope(model.args.head_dim, plain, 256)
    assert max_diff(np.array(model(ids)[0]), ref) > 100 * BOUND
    for layer, rope in zip(model.layers, ropes):
        layer.self_attn.rope = rope
    assert max_diff(np.array(model(ids)[0]), ref) <= BOUND


def test_experts_split_over_cpu_streams(case):
    """With 2 CPU streams the biased experts compute a prompt's rows in two shards (each shard
    its slice of the bias): the same logits as one stream, bit for bit."""
    from mlxformer.models.row_sharding import ShardedSwitchLinear

    directory, model, _, _, _ = case
    with cpu_default_device():
        split = load(directory, dtype=mx.float32, threads=2)[0]
        assert isinstance(split.layers[0].mlp.experts.gate_proj, ShardedSwitchLinear)
        ids = mx.array(tokens(SEQ_LEN)[None])
        assert mx.array_equal(split(ids), model(ids))


def test_sinks_in_the_score_paths_equal_the_fused_kernel():
    """The paths that compute scores themselves (soft-capping, quantized KV) count the sinks as
    ``mx.fast.scaled_dot_product_attention(..., sinks=)`` does."""
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32)) for s in ((2, 4, 5, 16), (2, 2, 9, 16), (2, 2, 9, 16)))
    sinks = mx.array(rng.standard_normal(4).astype(np.float32) * 2)
    for mask in (None, "causal"):
        fused = fused_attention(q, k, v, 0.25, mask, sinks)
        ours = softcapped_attention(q, k, v, 0.25, mask, None, sinks)
        assert mx.allclose(fused, ours, atol=1e-5), mask
        assert not mx.allclose(fused, fused_attention(q, k, v, 0.25, mask), atol=1e-2)


def test_quantized_kv_attention_counts_the_sinks():
    """8-bit keys/values: the quantized attention with sinks is within the cache's rounding of
    the fused kernel's (on the tiny model, 8-bit rounding flips expert choices, which moves
    log-probs by > 1 with or without sinks, so the check is made here, on one layer)."""
    rng = np.random.default_rng(1)
    q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32)) for s in ((1, 4, 3, 32), (1, 2, 9, 32), (1, 2, 9, 32)))
    sinks = mx.array(rng.standard_normal(4).astype(np.float32) * 2)
    cache = KVCache(bits=8, group_size=32)
    packed_keys, packed_values = cache.update_and_fetch(k, v)
    got = cache.attention(q, packed_keys, packed_values, 0.2, "causal", sinks=sinks)
    assert mx.abs(got - fused_attention(q, k, v, 0.2, "causal", sinks)).max().item() < 0.02
    assert mx.abs(got - fused_attention(q, k, v, 0.2, "causal")).max().item() > 0.1


def test_chunked_prefill_then_decode_past_the_window(case):
    """Chunks of 7 then single tokens: the sliding layers' rotating caches hold the window."""
    _, model, _, _, ref = case
    with cpu_default_device():
        steps = chunked_then_decoded(model, tokens(SEQ_LEN), PREFILL_LEN)
    assert max_diff(steps, ref[PREFILL_LEN - 1 :]) <= BOUND


def test_engine_batch_and_speculation_match_alone(case):
    """Greedy: each sequence of an engine batch (ragged prompts past the window) and prompt-lookup
    speculation give the tokens of plain decoding alone."""
    _, model, tokenizer, _, _ = case
    with cpu_default_device():
        assert_batch_and_speculation_match_alone(model, tokenizer)
