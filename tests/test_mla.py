"""GLM-4.5/4.6 (``glm4_moe``) and the multi-head latent attention families (DeepSeek-V2/V3,
GLM-4.7-Flash = ``glm4_moe_lite``) on tiny random checkpoints written by transformers' own config
classes (odd sizes; the routers' ``e_score_correction_bias`` randomised), against transformers'
eager logits; engine batch and speculative greedy identity; the latent cache's bytes.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch

from family_checks import PROMPTS, assert_batch_and_speculation_match_alone, chunked_then_decoded, hf_logits, tokens
from conftest import max_diff, write_byte_tokenizer, write_tiny_checkpoint
from mlxformer import convert, load, stream_generate
from mlxformer.cache import CacheSettings, make_cache
from mlxformer.engine import batch_generate
from mlxformer.generation.stream import decode_step, prefill
from mlxformer.loader import build_model
from mlxformer.models.moe import SparseMoE

BOUND = 3e-4  # fp32 on both sides
_ROUTED = dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, first_k_dense_replace=1,
               n_shared_experts=1, num_hidden_layers=3)
_MLA = dict(kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=20, num_attention_heads=5,
            num_key_value_heads=5, hidden_size=80)
CASES = {
    # grouped sigmoid routing with a correction bias, q/k norm, q/k/v biases, half the head rotated
    "glm4_moe": dict(_ROUTED, n_group=4, topk_group=2, head_dim=32, use_qk_norm=True, attention_bias=True,
                     routed_scaling_factor=2.5),
    # low-rank q, YaRN with mscale (softmax scale and rotated features), grouped sigmoid routing
    "deepseek_v3": dict(_ROUTED, **_MLA, q_lora_rank=48, n_group=2, topk_group=1, routed_scaling_factor=1.5,
                        max_position_embeddings=512,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                             original_max_position_embeddings=128, mscale=0.8,
                                             mscale_all_dim=0.7, beta_fast=32, beta_slow=1)),
    # plain q_proj (q_lora_rank None), softmax group-limited routing, two shared experts
    "deepseek_v2": dict(_ROUTED, **_MLA, q_lora_rank=None, topk_method="group_limited_greedy", n_group=4,
                        topk_group=2, n_shared_experts=2, routed_scaling_factor=1.3),
    # GLM-4.7-Flash: dense / sparse layers by mlp_layer_types, attention biases
    "glm4_moe_lite": dict(_ROUTED, **_MLA, q_lora_rank=40, mlp_layer_types=["dense", "sparse", "sparse"],
                          attention_bias=True, routed_scaling_factor=1.8),
}


pytestmark = pytest.mark.usefixtures("cpu_module")


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


reference = hf_logits


def test_forward(case):
    name, _, model, _, hf_model = case
    assert isinstance(model.layers[0].mlp, SparseMoE) is False and isinstance(model.layers[1].mlp, SparseMoE)
    for length in (80, 9):
        ids = tokens(length)
        assert max_diff(np.array(model(mx.array(ids[None]))[0]), reference(hf_model, ids)) <= BOUND, length


def test_chunked_prefill_then_decode(case):
    name, _, model, _, hf_model = case
    ids = tokens(40)
    assert max_diff(chunked_then_decoded(model, ids, 20), reference(hf_model, ids)[19:]) <= BOUND


def test_engine_batch_and_speculation_match_alone(case):
    name, _, model, tokenizer, _ = case
    assert_batch_and_speculation_match_alone(model, tokenizer)


def test_cache_bytes_per_token(case):
    """An MLA layer caches one latent (kv_lora_rank) and one rope key (qk_rope_head_dim) per
    token, not the expanded keys and values; the KV budget's probe and the footprint agree."""
    from mlxformer.engine.memory import KVSizer
    from mlxformer.tools.planning import footprint

    name, directory, model, _, _ = case
    a = model.args
    layers, elements = a.num_hidden_layers, 4  # float32
    if name == "glm4_moe":
        per_token = 2 * a.num_key_value_heads * a.head_dim * elements * layers
    else:
        per_token = (a.kv_lora_rank + a.qk_rope_head_dim) * elements * layers
        expanded = a.num_attention_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim) * elements * layers
        assert expanded / per_token > 3
    cache = make_cache(model)
    prefill(model, mx.array(tokens(256)), cache, step_size=100)
    assert sum(c.nbytes for c in cache) == 256 * per_token
    assert sum(x.nbytes for c in cache for x in c.state) == 256 * per_token
    assert KVSizer(model, CacheSettings()).bytes_for(256) == 256 * per_token
    plan = footprint(directory)
    assert plan.kv_bytes_per_token() == per_token // elements * plan.activation_bytes


@pytest.mark.parametrize("bits,bound", [(8, 0.2), (4, 1.0)])
def test_quantized_cache(case, bits, bound):
    """The quantized cache on the latent: chunked prefill then decode near transformers' logits
    (these O(1)-weight MoE models amplify the rounding: measured 8-bit 0.006-0.13, 4-bit
    0.35-0.81 relative; the attention itself is checked exactly in
    ``test_quantized_latent_attention_is_the_formula``), and the engine's batched decode on it
    equal to each prompt alone."""
    name, _, model, tokenizer, hf_model = case
    ids = tokens(40)
    settings = CacheSettings(kv_bits=bits, kv_group_size=32)
    cache = make_cache(model, settings)
    steps = [np.array(prefill(model, mx.array(ids[:24]), cache, step_size=13)[0])]
    for t in range(24, 40):
        steps.append(np.array(decode_step(model, mx.array(ids[t : t + 1]), cache)[0]))
    ref = reference(hf_model, ids)[23:]
    err = float(np.abs(np.stack(steps) - ref).max() / np.abs(ref).max())  # as tests/test_cache.py measures
    print(f"\n{name} {bits}-bit cache: max relative logit error {err:.4f}")
    assert 0 < err <= bound
    if bits == 8:
        alone = [[r.token for r in stream_generate(model, tokenizer, p, 10, cache_settings=settings)] for p in PROMPTS]
        got = batch_generate(model, tokenizer, PROMPTS, 10, max_batch=3, cache_settings=settings)
        assert got == [tokenizer.decode(t) for t in alone]


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_latent_attention_is_the_formula(bits):
    """``latent_attention`` on quantized storage (rotated, rope keys centered per block) equals
    the MLA formula computed in numpy on the stored values, across a center-block boundary."""
    from mlxformer.cache import KVCache
    from mlxformer.cache.codec import CENTER_BLOCK

    rng = np.random.default_rng(3)
    H, rank, rope, S = 5, 64, 32, CENTER_BLOCK + 40
    cache = KVCache(bits=bits, group_size=32)
    rope_keys = mx.array(rng.standard_normal((1, 1, S, rope)).astype(np.float32) + 2.0)  # offset: centers matter
    latents = mx.array(rng.standard_normal((1, 1, S, rank)).astype(np.float32))
    cache.update_and_fetch(rope_keys[:, :, : S - 1], latents[:, :, : S - 1])
    keys, values = cache.update_and_fetch(rope_keys[:, :, S - 1 :], latents[:, :, S - 1 :])
    q_latent = mx.array(rng.standard_normal((1, H, 1, rank)).astype(np.float32))
    q_rope = mx.array(rng.standard_normal((1, H, 1, rope)).astype(np.float32))
    out = np.array(cache.latent_attention(q_latent, q_rope, keys, values, 0.1, None))
    codec = cache.codec
    blocks = np.arange(S) // CENTER_BLOCK
    stored_keys = np.array(codec.decode(keys))[0, 0] + np.array(codec.key_center)[0, 0][blocks]  # (S, rope)
    stored_latents = np.array(codec.decode(values))[0, 0]  # (S, rank)
    assert np.abs(stored_keys - np.array(rope_keys)[0, 0]).max() < (0.1 if bits == 8 else 1.0)
    scores = 0.1 * (np.array(q_latent)[0, :, 0] @ stored_latents.T + np.array(q_rope)[0, :, 0] @ stored_keys.T)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    assert np.abs(out[0, :, 0] - probs @ stored_latents).max() < 2e-3


def test_prompt_cache_memory_disk_and_file(case, tmp_path):
    """The latent in the prompt cache: a shared prefix served from memory blocks, then from disk
    after a restart (the files checked against the latent's shapes), and a saved cache file
    loaded back; every output the one the prompt gets alone."""
    from mlxformer.generation.prompt_cache_files import load_prompt_cache, save_prompt_cache
    from mlxformer.engine import Engine, GenerationRequest
    from mlxformer.engine.prompt_cache import PromptCacheSettings

    name, _, model, tokenizer, _ = case
    system = list(range(10, 34))  # 3 blocks of 8
    first, second = system + list(range(40, 50)), system + list(range(60, 66))
    alone = {tuple(p): [r.token for r in stream_generate(model, tokenizer, p, 5)] for p in (first, second)}
    settings = PromptCacheSettings(memory_bytes=2**30, directory=str(tmp_path / "blocks"), block_size=8)
    with Engine(model, tokenizer, prompt_cache=settings) as engine:
        for prompt, cached in ((first, 0), (second, len(system))):
            events = list(engine.submit(GenerationRequest(prompt, max_tokens=5)))
            assert events[-1].cached_tokens == cached and [e.token for e in events] == alone[tuple(prompt)]
    with Engine(model, tokenizer, prompt_cache=settings) as engine:  # a restart: from disk
        events = list(engine.submit(GenerationRequest(second, max_tokens=5)))
        assert events[-1].cached_tokens >= len(system) and [e.token for e in events] == alone[tuple(second)]
    cache = make_cache(model)
    prefill(model, mx.array(first), cache)
    save_prompt_cache(tmp_path / "c.safetensors", cache, first, model, tokenizer)
    loaded, ids = load_prompt_cache(tmp_path / "c.safetensors", model, tokenizer)
    assert ids == first and all(mx.array_equal(a, b) for c, d in zip(cache, loaded) for a, b in zip(c.state, d.state))


def test_mlx_lm_dirs(case, tmp_path):
    """mlx-lm's own conversions of each checkpoint (float, and 4-bit as mlx-community dirs are
    made; MLA's ``kv_b_proj`` stored split as ``embed_q``/``unembed_out``) load in mlxformer with
    mlx-lm's logits, and ``mlxformer convert``'s (float and ``-q``) in both with equal logits;
    the float dirs also with transformers'. mlx-lm's DeepSeek-V3 router departs
    from transformers' here (it zeroes the groups left out, where transformers sets them to
    -inf; this checkpoint's random correction bias makes kept scores negative), so that family
    is compared with transformers only; and mlx-lm re-quantizes a quantized ``kv_b_proj`` into
    its split (another 4-bit rounding), so on our 4-bit MLA dirs it only has to load and run.
    mlx-lm's split float dirs also load from a dict of their arrays (``build_model``), whose
    ``kv_b_proj`` is joined by the same path as the lazy reader's."""
    import shutil

    from mlx_lm import convert as mlx_lm_convert
    from mlx_lm import load as mlx_lm_load

    from conftest import add_mlx_lm_config_keys

    name, directory, _, _, hf_model = case
    source = tmp_path / "hf"
    shutil.copytree(directory, source)
    config = add_mlx_lm_config_keys(source)
    config.setdefault("rope_scaling", None if name == "glm4_moe" else {"factor": 1.0})  # mlx-lm's args require it
    (source / "config.json").write_text(json.dumps(config))
    mlx_lm_convert(str(source), str(tmp_path / "mlx-lm"))
    mlx_lm_convert(str(source), str(tmp_path / "mlx-lm-q4"), quantize=True, q_group_size=32, q_bits=4)
    convert(source, tmp_path / "ours")
    convert(source, tmp_path / "ours-q4", quantize=True, q_group_size=32, q_bits=4)
    ids = tokens(40)
    for converted in ("mlx-lm", "mlx-lm-q4", "ours", "ours-q4"):
        stored = mx.load(str(tmp_path / converted / "model.safetensors"))
        split = converted.startswith("mlx-lm") and name in ("deepseek_v3", "glm4_moe_lite")
        assert split == any(".embed_q." in n for n in stored)  # mlx-lm's split kv_b_proj
        quantized = ".embed_q.scales" if split else ".scales"
        assert converted.endswith("q4") == any(n.endswith(quantized) for n in stored)
        theirs, _ = mlx_lm_load(str(tmp_path / converted))
        theirs.set_dtype(mx.float32)
        ours, _ = load(tmp_path / converted, dtype=mx.float32, threads=1)
        got = np.array(ours(mx.array(ids[None]))[0])
        requantized = converted == "ours-q4" and name in ("deepseek_v3", "glm4_moe_lite")
        if name != "deepseek_v3" and not requantized:
            assert max_diff(got, np.array(theirs(mx.array(ids[None]))[0])) <= 1e-3, converted
        if not converted.endswith("q4"):
            assert max_diff(got, reference(hf_model, ids)) <= BOUND
        if split and not converted.endswith("q4"):  # the same tensors as a dict of arrays: the same renames
            written = json.loads((tmp_path / converted / "config.json").read_text())
            from_dict = build_model(written, stored)
            from_dict.set_dtype(mx.float32)
            assert max_diff(np.array(from_dict(mx.array(ids[None]))[0]), reference(hf_model, ids)) <= BOUND



def test_multi_token_prediction_layer_is_dropped(tmp_path):
    """GLM-4.5 and DeepSeek-V3 checkpoints store ``num_nextn_predict_layers`` MTP layers after the
    decoder's (``model.layers.N``): they load without them, with unchanged logits; any other
    extra layer is still refused."""
    from safetensors.numpy import load_file, save_file

    from mlxformer.errors import MlxformerError

    directory, hf_model = write_family(tmp_path / "g", "glm4_moe", num_nextn_predict_layers=1)
    tensors = load_file(directory / "model.safetensors")
    extra = {k.replace("model.layers.2.", f"model.layers.{n}."): v for k, v in tensors.items()
             if k.startswith("model.layers.2.") for n in (3,)}
    save_file({**tensors, **extra}, directory / "model.safetensors")
    model, _ = load(directory, dtype=mx.float32)
    ids = tokens(12)
    assert max_diff(np.array(model(mx.array(ids[None]))[0]), reference(hf_model, ids)) <= BOUND
    edit = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**edit, "num_nextn_predict_layers": 0}))
    with pytest.raises(MlxformerError, match="config says 3 layers, but the tensors are for 4"):
        load(directory)
