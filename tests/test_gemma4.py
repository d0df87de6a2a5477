"""Gemma 4 (``gemma4_text``, and the image-text ``gemma4`` through its ``text_config``) on tiny
random checkpoints written by transformers' own ``Gemma4ForCausalLM`` (odd sizes): transformers'
eager logits for the full forward and for a chunked prefill then one-token decode past the
sliding window; engine batch and speculative greedy identity; the caches of the KV-shared
layers (none of their own) in the KV budget and the footprint; mlx-lm both ways.
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch

from conftest import max_diff, write_byte_tokenizer, write_tiny_checkpoint
from family_checks import assert_batch_and_speculation_match_alone, chunked_then_decoded, hf_logits, tokens
from mlxformer import convert, load
from mlxformer.cache import CacheSettings, make_cache
from mlxformer.generation.stream import prefill
from mlxformer.models.config import ModelArgs
from mlxformer.models.dtype_policy import float16_safe

BOUND = 3e-4  # fp32 on both sides
_SHAPE = dict(hidden_size=40, num_attention_heads=3, num_key_value_heads=1, head_dim=16, global_head_dim=24,
              intermediate_size=36, sliding_window=7, final_logit_softcapping=30.0, hidden_size_per_layer_input=0)
_S, _F = "sliding_attention", "full_attention"
CASES = {
    # 31B-like: full layers with their own head size, K = V with one global K/V head, proportional RoPE
    "dense": dict(_SHAPE, num_hidden_layers=4, layer_types=[_S, _F, _S, _F], attention_k_eq_v=True,
                  num_key_value_heads=3, num_global_key_value_heads=1,
                  rope_parameters={_S: {"rope_type": "default", "rope_theta": 10000.0},
                                   _F: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                        "rope_theta": 1e6}}),
    # 26B-A4B-like: routed experts beside every layer's MLP
    "moe": dict(_SHAPE, num_hidden_layers=3, layer_types=[_S, _S, _F], enable_moe_block=True, num_experts=5,
                top_k_experts=2, moe_intermediate_size=12),
    # E2B-like: per-layer token inputs, the last two layers reading earlier layers' K/V, double-wide MLP there
    "per_layer": dict(_SHAPE, num_hidden_layers=5, layer_types=[_S, _F, _S, _S, _F], hidden_size_per_layer_input=6,
                      vocab_size_per_layer_input=256, num_kv_shared_layers=2, use_double_wide_mlp=True),
}


pytestmark = pytest.mark.usefixtures("cpu_module")


def write_gemma4(directory, name):
    """A tiny checkpoint with random ``layer_scalar``s (transformers' buffers start at 1, which
    would hide a decoder ignoring them) and the byte tokenizer."""
    directory, hf_model = write_tiny_checkpoint(directory, "gemma4_text", **CASES[name])
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for buffer_name, buffer in hf_model.named_buffers():
            if buffer_name.endswith("layer_scalar"):
                buffer.copy_(0.5 + torch.rand(buffer.shape, generator=generator))
    hf_model.save_pretrained(directory)
    write_byte_tokenizer(directory)
    return directory, hf_model


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    directory, hf_model = write_gemma4(tmp_path_factory.mktemp(request.param), request.param)
    model, tokenizer = load(directory, dtype=mx.float32)
    tokenizer.eos_token_ids = []
    return request.param, directory, model, tokenizer, hf_model


def test_forward(case):
    name, _, model, _, hf_model = case
    a = model.args
    assert (a.model_type, a.global_head_dim, a.layer_scalar) == ("gemma4_text", 24, True)
    assert not float16_safe(a.model_type)  # the GPU plan never computes Gemma in float16
    assert [layer.self_attn.head_dim for layer in model.layers] == [
        24 if t == "full" else 16 for t in a.layer_types]
    for length in (30, 9):
        ids = tokens(length)
        assert max_diff(np.array(model(mx.array(ids[None]))[0]), hf_logits(hf_model, ids)) <= BOUND, length


def test_chunked_prefill_then_decode(case):
    """12 tokens prefilled in chunks of 5, then 18 decoded one at a time: past the 7-token window."""
    name, _, model, _, hf_model = case
    ids = tokens(30)
    assert max_diff(chunked_then_decoded(model, ids, 12, step_size=5), hf_logits(hf_model, ids)[11:]) <= BOUND


def test_engine_batch_and_speculation_match_alone(case):
    name, _, model, tokenizer, _ = case
    assert_batch_and_speculation_match_alone(model, tokenizer)


def test_kv_shared_layers_have_no_cache(case):
    """KV-shared layers own no cache and no k/v projections; the KV budget's probe and the
    footprint count each cache with its own layer's head size and K/V heads."""
    from mlxformer.engine.memory import KVSizer
    from mlxformer.tools.planning import footprint

    name, directory, model, _, _ = case
    a = model.args
    owners = a.num_hidden_layers - a.num_kv_shared_layers
    cache = make_cache(model)
    assert len(cache) == len(model.cache_layers) == owners
    shared = model.layers[owners:]
    assert all(layer.kv_source is not None and "k_proj" not in layer.self_attn for layer in shared)
    per_token = sum(2 * a.layer_kv_heads(i) * a.layer_head_dim(i) * 4 for i in range(owners))  # float32 K and V
    prefill(model, mx.array(tokens(6)), cache)  # within the window: every cache holds every token
    assert [tuple(c.state[0].shape) for c in cache] == [(1, a.layer_kv_heads(i), 6, a.layer_head_dim(i))
                                                        for i in range(owners)]
    assert sum(c.state[0].nbytes + c.state[1].nbytes for c in cache) == 6 * per_token  # keys, values
    plan = footprint(directory)
    assert plan.kv_bytes_per_token() == per_token // 4 * plan.activation_bytes
    growing = sum(2 * a.layer_kv_heads(i) * a.layer_head_dim(i) * 4 for i in range(owners) if a.layer_types[i] == "full")
    sizer = KVSizer(model, CacheSettings())  # past the window only the full layers' caches grow
    assert sizer.bytes_for(1024) - sizer.bytes_for(512) == 512 * growing


def test_prompt_cache_past_the_window(case):
    """Issue 30: a prompt longer than the sliding window (7) is served from the prompt cache: the
    sliding layers' caches are rebuilt from the blocks holding their last 7 tokens (cut after
    each chunk of 3, while the window held them), and the continuation is a cold engine's, token
    and log-probability bit for bit where the hit ends at one of the cold run's chunk ends.
    (Before: ``cached_tokens`` 0 for every such prompt.)"""
    from mlxformer.engine import Engine, GenerationRequest
    from mlxformer.engine.prompt_cache import PromptCacheSettings

    name, _, model, tokenizer, _ = case
    first = [int(t) for t in tokens(30)]
    second = first + [5, 6, 7]
    settings = dict(prompt_cache=PromptCacheSettings(memory_bytes=2**30, block_size=4), prefill_chunk=3)
    with Engine(model, tokenizer, **settings) as engine:
        cold = list(engine.submit(GenerationRequest(second, max_tokens=6, logprobs=0)))
    with Engine(model, tokenizer, **settings) as engine:
        list(engine.submit(GenerationRequest(first, max_tokens=6)))
        hit = list(engine.submit(GenerationRequest(second, max_tokens=6, logprobs=0)))
        again = list(engine.submit(GenerationRequest(second, max_tokens=6, logprobs=0)))
    assert cold[-1].cached_tokens == 0 and hit[-1].cached_tokens == len(first)
    assert again[-1].cached_tokens == len(second) - 1  # the same prompt again: all but its last token
    assert [(e.token, e.logprob) for e in hit] == [(e.token, e.logprob) for e in cold]  # cut where cold is cut
    # the last token alone (cold: inside the chunk 30..33): the same tokens, log-probabilities to rounding
    assert [e.token for e in again] == [e.token for e in cold]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(again, cold)) < 1e-5


def test_config_round_trip(case):
    """``to_dict`` (what ``convert`` writes) reads back to the same args."""
    _, _, model, _, _ = case
    assert ModelArgs.from_dict(model.args.to_dict()) == model.args


def test_image_text_checkpoint(tmp_path):
    """The hub's ``gemma4`` layout: the text model under ``model.language_model.`` with its
    config in ``text_config``, beside vision and audio towers (dropped)."""
    from safetensors.numpy import load_file, save_file

    directory, hf_model = write_gemma4(tmp_path / "text", "per_layer")
    tensors = load_file(directory / "model.safetensors")
    wrapped = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
    wrapped["model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"] = np.zeros((4, 4), np.float32)
    wrapped["model.embed_audio.embedding_projection.weight"] = np.zeros((4, 4), np.float32)
    save_file(wrapped, str(tmp_path / "text" / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({"model_type": "gemma4", "architectures": [
        "Gemma4ForConditionalGeneration"], "text_config": text, "vision_config": {"hidden_size": 4},
        "audio_config": {"hidden_size": 4}, "tie_word_embeddings": True}))
    model, _ = load(directory, dtype=mx.float32)
    ids = tokens(20)
    assert model.args.model_type == "gemma4_text" and model.args.num_kv_shared_layers == 2
    assert max_diff(np.array(model(mx.array(ids[None]))[0]), hf_logits(hf_model, ids)) <= BOUND


def test_unsupported_settings_are_refused():
    from mlxformer.errors import MlxformerError

    base = dict(model_type="gemma4_text", vocab_size=256, num_hidden_layers=2, hidden_size=40, intermediate_size=36,
                num_attention_heads=3, num_key_value_heads=1, head_dim=16, layer_types=[_S, _F])
    with pytest.raises(MlxformerError, match="num_kv_shared_layers"):
        ModelArgs.from_dict({**base, "num_kv_shared_layers": 2})
    with pytest.raises(MlxformerError, match="use_bidirectional_attention"):
        ModelArgs.from_dict({**base, "use_bidirectional_attention": "all"})
    from mlxformer.models.decoder import Model

    shared = ModelArgs.from_dict({**base, "num_hidden_layers": 3, "layer_types": [_S, _F, _F], "num_kv_shared_layers": 1})
    assert shared.kv_source(2) == 1 and shared.kv_source(1) is None
    with pytest.raises(MlxformerError, match="pipeline"):  # a stage without the layer it reads
        Model(shared, num_layers=1, first_layer=2)


def test_mlx_lm_both_ways(case, tmp_path):
    """``mlxformer convert``'s dir (float and 4-bit) loads in mlx-lm's ``gemma4_text`` with our
    logits, and mlx-lm's conversion of it loads in mlxformer with mlx-lm's logits; the float
    dirs also with transformers'."""
    from mlx_lm import convert as mlx_lm_convert
    from mlx_lm import load as mlx_lm_load

    name, directory, _, _, hf_model = case
    source = tmp_path / "hf"
    shutil.copytree(directory, source)
    (source / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    convert(source, tmp_path / "ours")
    convert(source, tmp_path / "ours-q4", quantize=True, q_group_size=32, q_bits=4)
    mlx_lm_convert(str(tmp_path / "ours"), str(tmp_path / "mlx-lm"))
    ids = tokens(30)
    for converted in ("ours", "ours-q4", "mlx-lm"):
        theirs, _ = mlx_lm_load(str(tmp_path / converted))
        theirs.set_dtype(mx.float32)
        ours, _ = load(tmp_path / converted, dtype=mx.float32, threads=1)
        got = np.array(ours(mx.array(ids[None]))[0])
        assert max_diff(got, np.array(theirs(mx.array(ids[None]))[0])) <= 1e-3, converted
        if not converted.endswith("q4"):
            assert max_diff(got, hf_logits(hf_model, ids)) <= BOUND, converted


def test_quantized_cache_with_shared_layers(tmp_path):
    """The 8-bit KV cache (head sizes 32 and 64, groups of 32): the KV-shared layers attend over
    their source layer's quantized storage; chunked prefill then decode stays near transformers'
    logits and the engine's batch on it equals each prompt alone."""
    from mlxformer import stream_generate
    from mlxformer.engine import batch_generate
    from mlxformer.generation.stream import decode_step

    directory, hf_model = write_tiny_checkpoint(tmp_path / "q", "gemma4_text", **{
        **CASES["per_layer"], "head_dim": 32, "global_head_dim": 64})
    write_byte_tokenizer(directory)
    model, tokenizer = load(directory, dtype=mx.float32)
    tokenizer.eos_token_ids = []
    ids = tokens(30)
    settings = CacheSettings(kv_bits=8, kv_group_size=32)
    cache = make_cache(model, settings)
    steps = [np.array(prefill(model, mx.array(ids[:12]), cache, step_size=5)[0])]
    for t in range(12, 30):
        steps.append(np.array(decode_step(model, mx.array(ids[t : t + 1]), cache)[0]))
    ref = hf_logits(hf_model, ids)[11:]
    err = float(np.abs(np.stack(steps) - ref).max() / np.abs(ref).max())
    # measured: 0.062 here, 0.051 for the same model without shared layers, 0.046 for "dense"
    # (these O(1)-weight models amplify the rounding; 4-bit: 0.53, 0.54, 0.42)
    assert 0 < err <= 0.15, err
    prompts = ["Once upon a time, in a land far away,", "abcabcabcabc"]
    alone = [[r.token for r in stream_generate(model, tokenizer, p, 8, cache_settings=settings)] for p in prompts]
    got = batch_generate(model, tokenizer, prompts, 8, max_batch=2, cache_settings=settings)
    assert got == [tokenizer.decode(t) for t in alone]


@pytest.fixture(scope="module")
def llama_cpp_ggufs(tmp_path_factory):
    """name -> (transformers model, HF dir, GGUF path, the converter's error or None): llama.cpp's
    own ``convert_hf_to_gguf.py`` on each checkpoint, given a Llama-style
    ``tokenizer.json`` (its Gemma 4 vocabulary reader needs a byte-fallback BPE) built from a
    tiny SentencePiece model."""
    import sentencepiece as sp

    from mlxformer.formats.gguf_vocab import spm_bpe_tokenizer
    from test_gguf_families import run_converter, write_spm_tokenizer

    root = tmp_path_factory.mktemp("gemma4_gguf")
    write_spm_tokenizer(root)
    pieces = sp.SentencePieceProcessor(model_file=str(root / "tokenizer.model"))
    tokens = [pieces.id_to_piece(i) for i in range(pieces.get_piece_size())]
    tokenizer = spm_bpe_tokenizer(tokens, [pieces.get_score(i) for i in range(len(tokens))], False)  # Gemma: no prefix
    out, jobs = {}, []
    for name in CASES:
        directory, hf_model = write_gemma4(root / name, name)
        tokenizer.save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
        out[name] = (hf_model, directory, root / f"{name}.gguf")
        jobs.append({"name": name, "argv": [str(directory), "--outtype", "f32", "--outfile", str(root / f"{name}.gguf")]})
    errors = run_converter(root, jobs)
    return {name: (*value, errors[name]) for name, value in out.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_llama_cpp_gguf(llama_cpp_ggufs, name):
    """The GGUF llama.cpp writes (per-layer K/V heads and feed-forward lengths, the two head
    sizes, ``rope_freqs`` as the proportional RoPE, K = V as a missing ``attn_v``, the layer
    scalar, per-layer input and expert tensors, the router's ``.scale``s, the ``gemma4``
    vocabulary) loads to the HF dir's
    settings, with transformers' logits on the vocabulary rows the converter keeps (the
    tokenizer's), and tokenizes as the HF tokenizer does."""
    from transformers import AutoTokenizer

    hf_model, directory, path, error = llama_cpp_ggufs[name]
    assert error is None, f"llama.cpp's converter failed: {error}"
    model, tokenizer = load(path, dtype=mx.float32)
    a, b = model.args, load(directory, dtype=mx.float32)[0].args
    fields = ("head_dim", "global_head_dim", "num_key_value_heads", "global_kv_heads", "attention_k_eq_v", "rope",
              "rope_local", "layer_types", "sliding_window", "num_kv_shared_layers", "double_wide_mlp",
              "hidden_size_per_layer_input", "vocab_size_per_layer_input", "final_logit_softcap", "intermediate_size",
              "experts_beside_mlp", "num_experts", "num_experts_per_tok", "moe_intermediate_size")
    assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
    n = a.vocab_size
    ids = np.random.default_rng(1).integers(3, n, size=30)
    got, ref = np.array(model(mx.array(ids[None]))[0]), hf_logits(hf_model, ids)[:, :n]
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    text = "the of and a to in is you"
    assert tokenizer.encode(text, add_special_tokens=False) == AutoTokenizer.from_pretrained(directory).encode(
        text, add_special_tokens=False)
