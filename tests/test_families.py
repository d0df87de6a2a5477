"""The dense families (Gemma 1/2/3, Phi-3/Phi-4-mini, Granite, OLMo 2/3, SmolLM3, Ministral 3) on tiny random
checkpoints written by transformers' own config classes, against transformers' eager logits.

Per family: the full forward over a prompt five windows long; a chunked prefill then
token-by-token decode through the caches each layer's attention asks for (rotating for
sliding layers, growing for global ones), float and 8-bit; every sequence of an engine batch
equals its greedy output alone; speculative decoding's greedy output equals plain decoding.
Each family switch is also shown to matter: turning it off moves the logits far past the bound.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from family_checks import assert_batch_and_speculation_match_alone, chunked_then_decoded, hf_logits
from conftest import cpu_default_device, log_softmax, max_diff, write_byte_tokenizer, write_tiny_checkpoint
from mlxformer import load
from mlxformer.cache import CacheSettings, KVCache, RotatingKVCache, make_cache
from mlxformer.models.rope_config import RopeConfig
from mlxformer.models.decoder import Model

WINDOW = 8
SEQ_LEN = 40
PREFILL_LEN = 20
BOUND = 3e-4  # fp32 on both sides, only summation order differs (measured <= 1.9e-4, Gemma 3)
SPECIAL_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # within the tiny vocabulary
LONGROPE = dict(  # Phi-4-mini's kind: 3/4 of each head rotated, LongRoPE past 32 positions
    rope_type="longrope", rope_theta=1e4, partial_rotary_factor=0.75,
    short_factor=[1.0 + 0.1 * i for i in range(6)], long_factor=[1.0 + 0.7 * i for i in range(6)],
)
MINISTRAL3_YARN = dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=16,
                      beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
# name -> (model_type, transformers config overrides)
CASES = {
    "gemma": ("gemma", dict(head_dim=32, hidden_act="gelu_pytorch_tanh")),
    "gemma2": ("gemma2", dict(head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24, num_hidden_layers=3,
                              attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("gemma3_text", dict(head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=16, num_hidden_layers=6,
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                    "full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                                                       "factor": 8.0}})),
    "phi3": ("phi3", dict(partial_rotary_factor=0.5, sliding_window=WINDOW, **SPECIAL_IDS)),
    "phi4mini-longrope": ("phi3", dict(max_position_embeddings=128, original_max_position_embeddings=32,
                                       rope_parameters=LONGROPE, **SPECIAL_IDS)),
    "granite": ("granite", dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.1,
                                logits_scaling=0.5)),
    "olmo2": ("olmo2", {}),
    "smollm3": ("smollm3", dict(no_rope_layer_interval=2, **SPECIAL_IDS)),
    # Devstral Small 2's kind: YaRN, and queries scaled by 1 + 0.1 log(1 + floor(p / 16)) past 16 positions
    "ministral3": ("ministral3", dict(head_dim=24, sliding_window=WINDOW, max_position_embeddings=64, seed=1, **SPECIAL_IDS,
                                      rope_parameters=dict(MINISTRAL3_YARN, llama_4_scaling_beta=0.1))),
    # OLMo 2's norms, 3 sliding layers to 1 global, YaRN on the global layers only
    "olmo3": ("olmo3", dict(sliding_window=WINDOW, num_hidden_layers=4, intermediate_size=96,
                            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                             "full_attention": dict(MINISTRAL3_YARN, mscale_all_dim=0.0)})),
}
# Each family's switches, turned off: the logits must then leave transformers' by far.
SWITCHES_OFF = {
    "gemma": dict(norm_offset=0.0, embedding_scale=1.0, hidden_act="silu"),
    "gemma2": dict(attn_logit_softcap=None, final_logit_softcap=None, layer_types=(), norm_layout="pre",
                   attention_scale=None),
    "gemma3": dict(rope_local=None, layer_types=("full",) * 6, qk_norm=False, rope=RopeConfig(theta=1e6)),
    "phi3": dict(partial_rotary_factor=1.0, sliding_window=None),
    "phi4mini-longrope": dict(rope=RopeConfig(theta=1e4)),
    "granite": dict(embedding_scale=1.0, residual_scale=1.0, attention_scale=None, logits_scale=1.0),
    "olmo2": dict(qk_norm=False, norm_layout="pre"),
    "smollm3": dict(rope_layers=()),
    "ministral3": dict(query_scale_beta=0.0, rope=RopeConfig(theta=1e4), sliding_window=None),
    "olmo3": dict(layer_types=(), rope_local=None, qk_norm=False),
}


def tokens(n: int = SEQ_LEN, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 256, size=n)


@pytest.fixture(scope="module", autouse=True)
def cpu_device():
    """The phi3 case also runs row-sharded over CPU streams, a CPU-only policy."""
    with cpu_default_device():
        yield


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, our float32 model and tokenizer, transformers model, transformers' logits of ``tokens()``)."""
    model_type, overrides = CASES[request.param]
    directory, hf_model = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), model_type, **overrides)
    write_byte_tokenizer(directory)
    model, tokenizer = load(directory, dtype=mx.float32, threads=2 if request.param == "phi3" else 1)
    tokenizer.eos_token_ids = []  # random weights: every run has all its tokens
    ref = hf_logits(hf_model, tokens())
    return request.param, model, tokenizer, hf_model, ref


def test_full_forward(case):
    name, model, _, _, ref = case
    got = np.array(model(mx.array(tokens()[None]))[0])
    assert max_diff(got, ref) <= BOUND
    assert float(log_softmax(ref).max(-1).mean()) > np.log(1 / 256) + 1.0  # far from uniform


def test_each_switch_matters(case):
    """The same weights with the family's switches off disagree with transformers."""
    name, model, _, _, ref = case
    plain = Model(dataclasses.replace(model.args, **SWITCHES_OFF[name]))
    plain.load_weights(tree_flatten(model.parameters()), strict=False)  # the names both models have
    plain.set_dtype(mx.float32)
    got = np.array(plain(mx.array(tokens()[None]))[0])
    assert max_diff(got, ref) > 100 * BOUND


def test_chunked_prefill_then_decode(case):
    """Chunks of 7 then single tokens through per-layer caches: sliding layers hold exactly the
    window, global layers everything.
    (LongRoPE switches factors when the sequence passes 32, as transformers does per forward:
    that case stays within 32 here.)"""
    name, model, _, hf_model, ref = case
    length = 30 if name == "phi4mini-longrope" else SEQ_LEN
    ids = tokens(length)
    if length != SEQ_LEN:
        ref = hf_logits(hf_model, ids)
    # 8-bit on Gemma 2: quantized keys with soft-capping. (On these chaotic random models 8-bit
    # moves Gemma 3's log-probs by up to 2.9, with or without its windows, and 4-bit by 10-15:
    # rounding, too close to a wrong window's effect to tell them apart.)
    for bits in (None, 8) if name == "gemma2" else (None,):
        cache = make_cache(model, CacheSettings(kv_bits=bits, kv_group_size=32))
        for layer, layer_cache in zip(model.layers, cache):
            if layer.window is None:
                assert isinstance(layer_cache, KVCache)
            else:
                assert isinstance(layer_cache, RotatingKVCache) and layer_cache.max_size == layer.window
        steps = chunked_then_decoded(model, ids, PREFILL_LEN, cache)
        # float: summation order only; 8-bit: the cache rounding (measured 0.40 with soft-capping; a wrong
        # window or RoPE moves log-probs by > 2)
        assert max_diff(steps, ref[PREFILL_LEN - 1 :]) <= (BOUND if bits is None else 0.5), bits


def test_engine_batch_and_speculation_match_alone(case):
    """Greedy: each sequence of an engine batch (ragged prompts past the window) and
    speculative decoding (prompt lookup) give the tokens of plain decoding alone."""
    name, model, tokenizer, _, _ = case
    responses = assert_batch_and_speculation_match_alone(model, tokenizer)
    assert responses[-1].proposed_tokens > 0
