"""Hybrid Gated DeltaNet models (Qwen3.5 dense ``qwen3_5_text``, Qwen3.5-MoE ``qwen3_5_moe_text``,
Qwen3-Next ``qwen3_next``) on tiny random checkpoints written by transformers' own config
classes, against transformers' eager logits: the full forward, chunked prefill then decode through
the mixed state/KV caches, one token at a time; the two forms of the delta rule against each
other; greedy generation with speculation (state rollback), quantized KV on the attention layers,
prompt-cache files and chat turns reusing the cache.

Odd sizes: 2 key heads and 4 value heads of 12 and 10 features, a 4-wide conv, 3 linear layers
to 1 attention layer (head_dim 32, a quarter of it rotated).
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch

from conftest import max_diff, write_byte_tokenizer, write_tiny_checkpoint
from mlxformer import load, stream_generate
from mlxformer.cache import CacheSettings, KVCache, StateCache, make_cache
from mlxformer.generation.prompt_cache_files import load_prompt_cache, save_prompt_cache
from mlxformer.errors import MlxformerError
from mlxformer.generation.stream import decode_step, prefill
from mlxformer.models import gated_delta
from mlxformer.models.gated_delta import GatedDeltaNet, chunked_delta_rule, recurrent_delta_rule
from mlxformer.speculative.speculator import SpeculativeSettings

from family_checks import tokens
from pool_support import held, seated

# fp32 on both sides. Measured: qwen3_5_text 1.7e-4, qwen3_5_moe_text 2.3e-4, qwen3_next 1.2e-3
# (the same with the recurrent form alone: the random MoE amplifies float32 rounding).
BOUND = 3e-3
HYBRID = dict(num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=12, linear_value_head_dim=10, linear_conv_kernel_dim=4)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)
CASES = {"qwen3_5_text": {}, "qwen3_5_moe_text": EXPERTS, "qwen3_next": EXPERTS}


pytestmark = pytest.mark.usefixtures("cpu_module")


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    directory, hf_model = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param,
                                                **HYBRID, **CASES[request.param])
    write_byte_tokenizer(directory)
    model, tokenizer = load(directory, dtype=mx.float32, threads=1)
    tokenizer.eos_token_ids = []
    return request.param, directory, model, tokenizer, hf_model


def reference(hf_model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor(ids[None])).logits[0].numpy()


def test_full_forward_matches_transformers(case):
    name, _, model, _, hf_model = case
    kinds = [layer.mixer_name for layer in model.layers]
    assert kinds == ["linear_attn"] * 3 + ["self_attn"]
    assert isinstance(model.layers[0].linear_attn, GatedDeltaNet)
    ids = tokens(150)  # three chunks of the parallel form, the last one partial
    assert max_diff(np.array(model(mx.array(ids[None]))[0]), reference(hf_model, ids)) <= BOUND


def test_chunked_prefill_then_decode_and_token_by_token(case):
    """Prefill chunks of 5 and 3 tokens end inside the 4-wide conv window, then decode."""
    _, _, model, _, hf_model = case
    ids = tokens(40, seed=2)
    ref = reference(hf_model, ids)
    for step in (5, 3):
        cache = make_cache(model)
        assert [type(c) for c in cache] == [StateCache] * 3 + [KVCache]
        rows = [np.array(prefill(model, mx.array(ids[:23]), cache, step_size=step))]
        rows += [np.array(decode_step(model, mx.array([int(t)]), cache)) for t in ids[23:]]
        assert max_diff(np.concatenate(rows), ref[22:]) <= BOUND, step
    cache = make_cache(model)
    rows = [np.array(decode_step(model, mx.array([int(t)]), cache)) for t in ids]
    assert max_diff(np.concatenate(rows), ref) <= BOUND
    assert all(c.offset == len(ids) for c in cache)


@pytest.mark.parametrize("chunk", [gated_delta.CPU_CHUNK, gated_delta.CHUNK])
def test_chunked_and_recurrent_forms_agree(chunk):
    """The parallel form (several chunks, a partial last one, a carried-in state; the CPU's and
    the GPU's chunk size) equals the token-by-token recurrence; a wrong decay in either moves
    the outputs by O(1)."""
    rng = np.random.default_rng(0)
    B, H, L, Dk, Dv = 2, 3, 150, 12, 10

    def arr(*shape, scale=1.0):
        return mx.array(rng.standard_normal(shape).astype(np.float32) * scale)

    q, k = arr(B, H, L, Dk), arr(B, H, L, Dk)
    q, k = gated_delta.l2_normalize(q) * Dk**-0.5, gated_delta.l2_normalize(k)
    v, state = arr(B, H, L, Dv), arr(B, H, Dk, Dv, scale=0.5)
    g = -mx.abs(arr(B, H, L, scale=0.3))
    beta = mx.sigmoid(arr(B, H, L))
    out_c, state_c = chunked_delta_rule(q, k, v, g, beta, state, chunk)
    out_r, states = recurrent_delta_rule(q, k, v, g, beta, state)
    assert np.abs(np.array(out_c - out_r)).max() < 1e-4
    assert np.abs(np.array(state_c - states[-1])).max() < 1e-4
    assert np.abs(np.array(out_r)).max() > 0.1


def test_speculative_greedy_equals_plain(case):
    """Prompt lookup on a repetitive prompt: rejected proposals roll the state caches back."""
    _, _, model, tokenizer, _ = case
    prompt = "one two one two one two one two three one two"
    plain = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=24)]
    settings = SpeculativeSettings(prompt_lookup=True, num_draft_tokens=3, ngram_min=1)
    fast = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=24, speculative=settings)]
    assert fast == plain


def test_hybrid_draft_model_greedy_equals_plain(case, tmp_path_factory):
    """A hybrid draft (another random Qwen3.5) for each hybrid target: most proposals are
    rejected, so both models' state caches are taken back every round."""
    _, _, model, tokenizer, _ = case
    draft_dir, _ = write_tiny_checkpoint(tmp_path_factory.mktemp("draft"), "qwen3_5_text", seed=1, **HYBRID)
    write_byte_tokenizer(draft_dir)
    draft, _ = load(draft_dir, dtype=mx.float32, threads=1)
    prompt = "a draft model proposes"
    plain = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=20)]
    settings = SpeculativeSettings(draft_model=draft, draft_tokenizer=tokenizer, num_draft_tokens=3)
    fast = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=20, speculative=settings)]
    assert fast == plain


def test_state_cache_trims_what_it_keeps(case):
    """``trim`` takes back up to ``keep`` tokens exactly (logits as if never fed), no further."""
    _, _, model, _, _ = case
    ids = tokens(30, seed=3)
    cache = make_cache(model, CacheSettings(rewind=3))
    prefill(model, mx.array(ids[:20]), cache)
    expected = np.array(decode_step(model, mx.array([int(ids[20])]), cache))
    for c in cache:
        assert c.trim(1) == 1
    model(mx.array(ids[None, 20:23]), cache)  # three tokens fed, then taken back
    assert all(c.trim(3) == 3 for c in cache)
    again = np.array(decode_step(model, mx.array([int(ids[20])]), cache))
    assert np.abs(again - expected).max() < 1e-5
    state_cache = cache[0]  # after 21 tokens it holds the states of the last 3 (and the one before)
    assert isinstance(state_cache, StateCache) and state_cache.trim(10) == 1


def test_quantized_kv_only_on_attention_layers(case):
    _, _, model, _, hf_model = case
    ids = tokens(40, seed=4)
    cache = make_cache(model, CacheSettings(kv_bits=8, kv_group_size=32))
    assert [type(c) for c in cache] == [StateCache] * 3 + [KVCache] and cache[3].quantized
    rows = [np.array(prefill(model, mx.array(ids[:30]), cache, step_size=7))]
    rows += [np.array(decode_step(model, mx.array([int(t)]), cache)) for t in ids[30:]]
    assert max_diff(np.concatenate(rows), reference(hf_model, ids)[29:]) < 0.5  # 8-bit keys/values: rounding


def test_prompt_cache_file_round_trip(case, tmp_path):
    _, _, model, tokenizer, _ = case
    ids = [int(t) for t in tokens(30, seed=5)]
    cache = make_cache(model)
    prefill(model, mx.array(ids[:25]), cache)
    save_prompt_cache(tmp_path / "c.safetensors", cache, ids[:25], model, tokenizer)
    loaded, held = load_prompt_cache(tmp_path / "c.safetensors", model, tokenizer)
    assert held == ids[:25] and [type(c) for c in loaded] == [type(c) for c in cache]
    resumed = np.array(prefill(model, mx.array(ids[25:]), loaded))
    assert np.array_equal(resumed, np.array(prefill(model, mx.array(ids[25:]), cache)))  # bit for bit
    cold = np.array(prefill(model, mx.array(ids), make_cache(model)))  # the chunked form over all 30
    assert np.abs(resumed - cold).max() < 1e-4
    # a file whose recurrent state does not fit the model is refused naming the layer
    arrays, metadata = mx.load(str(tmp_path / "c.safetensors"), return_metadata=True)
    arrays["layer.0.1"] = arrays["layer.0.1"][:, :2]
    mx.save_safetensors(str(tmp_path / "bad.safetensors"), arrays, metadata)
    with pytest.raises(MlxformerError, match="layer 0: array 1 has shape"):
        load_prompt_cache(tmp_path / "bad.safetensors", model, tokenizer)
    classes = json.loads(metadata["classes"])
    metadata["classes"] = json.dumps(["KVCache"] * len(classes))
    mx.save_safetensors(str(tmp_path / "bad2.safetensors"), arrays, metadata)
    with pytest.raises(MlxformerError, match="do not fit the model's attention and recurrent layers"):
        load_prompt_cache(tmp_path / "bad2.safetensors", model, tokenizer)


def test_config_round_trip_and_bad_config(case):
    from mlxformer.models.config import ModelArgs

    name, directory, model, _, _ = case
    assert ModelArgs.from_dict(model.args.to_dict()) == model.args
    config = json.loads((directory / "config.json").read_text())
    with pytest.raises(MlxformerError, match="multiple of linear_num_key_heads"):
        ModelArgs.from_dict({**config, "linear_num_key_heads": 3})
    with pytest.raises(MlxformerError, match="layer_types"):
        ModelArgs.from_dict({**config, "layer_types": ["linear_attention", "sliding_attention"] * 2})


ENGINE_PROMPTS = ["the cat sat on the", "one two one two one", "xyz", "a longer prompt of a few more words"]


def test_engine_batches_hybrid_rows_as_alone(case, monkeypatch):
    """Four concurrent requests: their recurrent states in rows of one decode batch (stacked per
    layer, ``cache/state_rows.py``), each row's reply equal to the one it gives alone; then a
    speculating engine."""
    from mlxformer.cache.state_rows import StateRows
    from mlxformer.engine import batch_generate

    _, _, model, tokenizer, _ = case
    stepping_rows: list[int] = []
    real_advance = StateRows.advance

    def advance(self, inputs, states):
        stepping_rows.append(inputs.shape[0])
        real_advance(self, inputs, states)

    monkeypatch.setattr(StateRows, "advance", advance)
    alone = [tokenizer.decode([r.token for r in stream_generate(model, tokenizer, p, 10)]) for p in ENGINE_PROMPTS]
    assert batch_generate(model, tokenizer, ENGINE_PROMPTS, 10, max_batch=4, prefill_chunk=5) == alone
    assert max(stepping_rows) >= 3  # rows decode together (they start and end at their own steps)
    lookup = SpeculativeSettings(prompt_lookup=True, num_draft_tokens=3, ngram_min=1)
    assert batch_generate(model, tokenizer, ENGINE_PROMPTS, 10, max_batch=4, speculative=lookup) == alone


def test_engine_preempts_and_replays_hybrid_rows(case):
    """Rows preempted mid-decode (three times, as the KV budget does: states dropped, the
    prompt and generated tokens recomputed) give the replies each gives alone; the KV budget
    counts the state bytes."""
    from mlxformer.cache.state import state_nbytes
    from mlxformer.engine import Engine, GenerationRequest

    _, _, model, tokenizer, _ = case
    prompts = [[(11 * i + 5 * j) % 250 + 1 for j in range(20 + i)] for i in range(4)]
    expected = [tokenizer.decode([r.token for r in stream_generate(model, tokenizer, p, 24)]) for p in prompts]
    engine = Engine(model, tokenizer, max_batch=4, prefill_chunk=8)
    kv_block = engine.sizer.bytes_for(257) - engine.sizer.bytes_for(1)  # the attention layer's growth
    assert engine.sizer.bytes_for(1) == kv_block + 3 * state_nbytes(model.args, 1, mx.float32)
    real_run, steps = engine._run, [0]

    def run(step):
        real_run(step)
        steps[0] += 1
        if steps[0] in (6, 12, 18) and engine.scheduler.running:
            engine.departures.preempt(engine.scheduler.running[0])

    engine._run = run
    with engine:
        handles = [engine.submit(GenerationRequest(p, 24)) for p in prompts]
        replies = ["".join(e.text for e in h) for h in handles]
    assert replies == expected
    assert engine.metrics.registry.get_sample_value("mlxformer_preemptions_total") == 3


def test_prefix_cache_resumes_from_a_state_snapshot(case):
    """A finished sequence's blocks keep the recurrent states where its cache ended: a new turn
    extending it resumes there with exactly the logits of the first sequence's own caches; a
    prompt that leaves it inside the cached tokens finds no snapshot, so no hit."""
    from mlxformer.engine.prefix_cache import PrefixCache

    _, _, model, _, _ = case
    first = [int(t) for t in tokens(75, seed=6)]  # two 32-token blocks and an 11-token tail
    own = make_cache(model)
    prefill(model, mx.array(first), own)
    prefix = PrefixCache(10**8, model, CacheSettings())
    prefix.insert(first, held(own))
    second = first + [5, 6, 7]
    hit, n = prefix.lookup(second)
    assert n == len(first) and [h.storage.recurrent for h in hit] == [layer.recurrent for layer in model.cache_layers]
    got = model.last_logits(mx.array([second[n:]]), seated(model, hit))
    assert mx.array_equal(got, model.last_logits(mx.array([second[n:]]), own)).item()  # bit for bit
    assert prefix.lookup(first[:70] + [9, 9]) is None  # the states after 70 tokens are not kept
    assert prefix.lookup(first[:64] + [9]) is None


def test_engine_turns_reuse_the_prefix_cache(case):
    """A second turn extending the first (prompt + reply + more) hits the prefix cache for the
    whole first turn, and its greedy reply equals a cold run's."""
    from mlxformer.engine import Engine, GenerationRequest

    _, _, model, tokenizer, _ = case
    turn1 = [int(t) for t in tokens(50, seed=7)]
    engine = Engine(model, tokenizer, max_batch=2, prefill_chunk=16, prefix_cache_bytes=10**8)
    with engine:
        reply = [e.token for e in engine.submit(GenerationRequest(turn1, 12)) if e.token is not None]
        turn2 = turn1 + reply + [int(t) for t in tokens(20, seed=8)]
        second = [e.token for e in engine.submit(GenerationRequest(turn2, 12)) if e.token is not None]
    hits = engine.metrics.registry.get_sample_value("mlxformer_prefix_cache_hit_tokens_total")
    assert hits >= len(turn1) + len(reply) - 1
    assert second == [r.token for r in stream_generate(model, tokenizer, turn2, 12)]


def test_image_text_checkpoint_loads_its_language_model(tmp_path_factory):
    """The hub's Qwen3.5/3.6 are image-text checkpoints: ``model_type`` qwen3_5 with the text
    model's settings under ``text_config``, weights under ``model.language_model.``, a vision
    tower and MTP weights beside them. The language model loads with the text checkpoint's logits."""
    import shutil

    from safetensors.numpy import load_file, save_file

    text_dir, _ = write_tiny_checkpoint(tmp_path_factory.mktemp("text"), "qwen3_5_text", **HYBRID)
    write_byte_tokenizer(text_dir)
    image_text = tmp_path_factory.mktemp("image_text")
    tensors = {(f"model.language_model.{k[len('model.'):]}" if k.startswith("model.") else k): v
               for k, v in load_file(text_dir / "model.safetensors").items()}
    tensors["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((3, 3), np.float32)
    tensors["mtp.fc.weight"] = np.zeros((3, 3), np.float32)
    save_file(tensors, str(image_text / "model.safetensors"), metadata={"format": "pt"})
    text_config = json.loads((text_dir / "config.json").read_text())
    (image_text / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text_config, "vision_config": {"depth": 1}}))
    shutil.copy(text_dir / "tokenizer.json", image_text / "tokenizer.json")
    text_model, _ = load(text_dir, dtype=mx.float32, threads=1)
    model, _ = load(image_text, dtype=mx.float32, threads=1)
    assert model.args == text_model.args
    ids = mx.array([[5, 6, 7, 8, 9, 10]])
    assert mx.array_equal(model(ids), text_model(ids)).item()


def test_transformers_written_qwen3_5_moe_config_loads(tmp_path):
    """Issue 44: ``Qwen3_5MoeTextConfig`` writes no ``intermediate_size`` (every layer is experts);
    the checkpoint loads (before: "config intermediate_size is not a positive integer below
    2**31: None") with transformers' logits."""
    from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig

    from conftest import TINY_SHAPE, perturb_

    shape = {k: v for k, v in TINY_SHAPE.items() if k != "intermediate_size"}
    config = Qwen3_5MoeTextConfig(**{**shape, **HYBRID, **EXPERTS})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    perturb_(hf_model)
    hf_model.eval().save_pretrained(tmp_path)
    assert "intermediate_size" not in json.loads((tmp_path / "config.json").read_text())
    write_byte_tokenizer(tmp_path)
    model, _ = load(tmp_path, dtype=mx.float32, threads=1)
    ids = tokens(40)
    assert max_diff(np.array(model(mx.array(ids[None]))[0]), reference(hf_model, ids)) <= BOUND


@pytest.mark.parametrize("model_type,mlx_lm_type", [("qwen3_5_text", "qwen3_5"), ("qwen3_next", "qwen3_next")])
def test_mlx_lm_conversions_load(model_type, mlx_lm_type, tmp_path_factory):
    """mlx-lm's own ``convert`` (float, and 4-bit with its 8-bit router gates, as mlx-community
    dirs are made): conv1d stored ``(C, K, 1)``, the norms' ``1 +`` folded in, Qwen3.5 under
    ``language_model.``; they load with mlx-lm's logits (and transformers' for the float dir).
    (mlx-lm 0.32.2 cannot convert a transformers-5 ``qwen3_5_moe`` checkpoint: it expects the
    hub's fused expert tensors.)"""
    from conftest import add_mlx_lm_config_keys, edit_config
    from mlx_lm import convert as mlx_lm_convert
    from mlx_lm import load as mlx_lm_load

    root = tmp_path_factory.mktemp(mlx_lm_type)
    source, hf_model = write_tiny_checkpoint(root / "hf", model_type, **HYBRID, **CASES[model_type])
    write_byte_tokenizer(source)
    add_mlx_lm_config_keys(source)
    edit_config(source, model_type=mlx_lm_type)  # mlx-lm knows the image-text type, reading a flat config as the text one
    mlx_lm_convert(str(source), str(root / "float"))
    mlx_lm_convert(str(source), str(root / "q4"), quantize=True, q_group_size=32, q_bits=4)
    ids = tokens(40)
    for name in ("float", "q4"):
        theirs, _ = mlx_lm_load(str(root / name))
        theirs.set_dtype(mx.float32)
        ours, _ = load(root / name, dtype=mx.float32, threads=1)
        assert ours.args.linear_conv_channels_last and ours.args.norm_offset == 0.0
        got = np.array(ours(mx.array(ids[None]))[0])
        assert max_diff(got, np.array(theirs(mx.array(ids[None]))[0])) <= 1e-3, name  # measured <= 3.4e-4
        if name == "float":
            assert max_diff(got, reference(hf_model, ids)) <= BOUND


def test_chat_keeps_the_hybrid_cache_between_turns():
    """A random hybrid model with SmolLM2's vocabulary and chat template: the second turn
    prefills only what the cache does not hold, and replies as a fresh generation does."""
    from mlx.utils import tree_flatten, tree_unflatten

    from mlxformer.generation.chat import ChatSession
    from mlxformer.default_model import default_model_path
    from mlxformer.models.config import ModelArgs
    from mlxformer.models.decoder import Model

    tokenizer = load(default_model_path())[1]
    mx.random.seed(3)
    model = Model(ModelArgs.from_dict(dict(
        model_type="qwen3_5_text", hidden_size=64, num_hidden_layers=4, intermediate_size=96,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=49152, **{
            k: v for k, v in HYBRID.items() if k.startswith("linear_")})))
    params = [(k, mx.random.normal(v.shape) * 0.5) for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(params))
    session = ChatSession(model, tokenizer, system="Be brief.", max_tokens=8)
    first = list(session.send("Hello there"))
    cached = list(session.cached_ids)
    second = list(session.send("Tell me more."))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
                {"role": "assistant", "content": "".join(r.text for r in first)},
                {"role": "user", "content": "Tell me more."}]
    ids2 = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
    common = next(i for i, (a, b) in enumerate(zip(ids2 + [-1], cached + [-2])) if a != b)
    assert common >= len(cached) - 1  # the re-rendered conversation extends what the cache holds
    assert session.last_prefill_tokens == len(ids2) - common
    assert [r.token for r in second] == [r.token for r in stream_generate(model, tokenizer, ids2, 8)]


def test_convert_round_trip(case, tmp_path):
    """``convert`` writes the hybrid config (layer types, DeltaNet sizes) and weights (in mlx-lm's
    layout: ``tests/test_hybrid_formats.py``) that load back to the same logits; ``-q`` (through
    the activation calibration) quantizes the DeltaNet projections too."""
    import dataclasses

    from mlx.utils import tree_flatten

    from mlxformer import convert

    _, directory, model, _, _ = case
    ids = mx.array([[5, 6, 7, 8, 9, 10, 11, 12, 13]])
    convert(directory, tmp_path / "float")
    again, _ = load(tmp_path / "float", dtype=mx.float32, threads=1)
    assert dataclasses.replace(again.args, norm_offset=1.0, linear_conv_channels_last=False) == model.args
    assert mx.array_equal(again(ids), model(ids)).item()
    convert(directory, tmp_path / "q8", quantize=True, q_group_size=32, q_bits=8)
    quantized, _ = load(tmp_path / "q8", dtype=mx.float32, threads=1)
    names = [n for n, _ in tree_flatten(quantized.parameters())]
    assert any("linear_attn.in_proj_" in n and n.endswith(".scales") for n in names)


def test_footprint_counts_attention_layers_and_states(case):
    """``info``'s KV figures: keys/values for the one attention layer per token, plus the three
    recurrent layers' fixed states (the caches' own ``nbytes`` after prefill)."""
    from mlxformer.tools.planning import footprint

    _, directory, model, _, _ = case
    plan = footprint(directory)
    cache = make_cache(model)
    prefill(model, mx.array(tokens(256)), cache)
    mx.eval([c.state for c in cache])
    held = sum(c.nbytes for c in cache)
    assert plan.kv_bytes_per_token() == 2 * 2 * 32 * plan.activation_bytes  # 1 layer x (k, v) x 2 heads x 32
    assert plan.kv_bytes(256) == held


def test_tensor_parallel_refuses_hybrid_models(case):
    from mlxformer.distributed.tensor import check_divisible

    with pytest.raises(MlxformerError, match="(mixture-of-experts|Gated DeltaNet).*--parallel pipeline"):
        check_divisible(case[2].args, 2)
