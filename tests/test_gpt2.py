"""GPT-2 (learned positions, LayerNorm, GELU-tanh, fused ``c_attn``, ``Conv1D`` weights, tied
output) on a tiny random checkpoint written by transformers' own ``GPT2LMHeadModel``, against
transformers' eager logits and greedy tokens; the same through the caches, the engine (rows at
different positions in one step, prompt chunks packed beside decoding rows, the prefix cache,
speculation), up to the last learned position; the hub's names, ``convert`` output read by
mlx-lm and mlx-lm's own conversions read by us (against mlx-lm's logits), and the GGUF that
llama.cpp's own ``convert_hf_to_gguf.py`` writes from the checkpoint.
"""

from __future__ import annotations

import json
import random

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch

from conftest import cpu_default_device, log_softmax, max_diff, write_byte_tokenizer
from family_checks import assert_batch_and_speculation_match_alone, chunked_then_decoded, hf_logits, tokens
from mlxformer import convert, load, stream_generate
from mlxformer.engine import Engine, GenerationRequest
from mlxformer.errors import MlxformerError
from mlxformer.tools.planning import footprint

SEQ_LEN = 40
BOUND = 3e-4  # float32 on both sides (measured <= 1e-6)
POSITIONS = 512  # n_positions: the engine test's prompts (up to 300 tokens) and replies fit
CHUNK = 64


def tiny_gpt2(directory, vocab_size: int = 256, seed: int = 0, **config_fields):
    """A 2-layer GPT-2 saved by transformers (``n_ctx`` added, as the hub's GPT-2 configs
    carry it and llama.cpp's converter reads it); returns transformers' float32 eager model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=POSITIONS,
                        bos_token_id=1, eos_token_id=2, **config_fields)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # O(1) values, as ``conftest.perturb_`` gives, for GPT-2's names and (in, out) Conv1D
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                param.copy_(1.0 + 0.3 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.5 * noise)
            elif name.endswith(("wte.weight", "wpe.weight")):  # positions as strong as tokens
                param.copy_((0.3 if "wte" in name else 0.5) * noise)
            else:  # peaked attention (c_attn x 3): greedy replies that do not collapse to one token
                param.copy_((3.0 if "c_attn" in name else 1.5) * noise / param.shape[0] ** 0.5)
    model.save_pretrained(directory)
    config_path = directory / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "n_ctx": POSITIONS}))
    return model


@pytest.fixture(scope="module", autouse=True)
def cpu_device():
    with cpu_default_device():
        yield


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """(directory, our float32 model and tokenizer, transformers model, its logits of ``tokens(SEQ_LEN)``)."""
    directory = tmp_path_factory.mktemp("gpt2")
    hf_model = tiny_gpt2(directory)
    write_byte_tokenizer(directory)
    model, tokenizer = load(directory, dtype=mx.float32)
    tokenizer.eos_token_ids = []  # random weights: every run has all its tokens
    return directory, model, tokenizer, hf_model, hf_logits(hf_model, tokens(SEQ_LEN))


def test_full_forward(gpt2):
    _, model, _, _, ref = gpt2
    got = np.array(model(mx.array(tokens(SEQ_LEN)[None]))[0])
    assert max_diff(got, ref) <= BOUND
    assert float(log_softmax(ref).max(-1).mean()) > np.log(1 / 256) + 1.0  # far from uniform
    args = model.args
    assert (args.norm_type, args.position_type, args.gated_mlp, args.tie_word_embeddings) == ("layer", "learned", False, True)


def test_greedy_tokens_equal_transformers(gpt2):
    """Our greedy decoding (prefill, then one token at a time through the caches) picks
    transformers' greedy tokens (its ``generate``, no cache of ours involved)."""
    _, model, tokenizer, hf_model, _ = gpt2
    prompt = [int(t) for t in tokens(12, seed=3)]
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(prompt):].tolist()
    assert [r.token for r in stream_generate(model, tokenizer, prompt, 16)] == ref


def test_chunked_prefill_then_decode(gpt2):
    """Chunks of 7 then single tokens: each forward's positions continue from the cache's offset."""
    _, model, _, _, ref = gpt2
    steps = chunked_then_decoded(model, tokens(SEQ_LEN), 20)
    assert max_diff(steps, ref[19:]) <= BOUND


def test_engine_batch_and_speculation_match_alone(gpt2):
    """Ragged prompts decoding as one batch (each row at its own position) and prompt-lookup
    speculation (several positions a step) give the greedy tokens of each prompt alone."""
    _, model, tokenizer, _, _ = gpt2
    responses = assert_batch_and_speculation_match_alone(model, tokenizer)
    assert responses[-1].proposed_tokens > 0


def test_prompts_packed_beside_decoding_rows_and_the_prefix_cache_equal_alone(gpt2):
    """Prompts of different lengths prefilled in the same steps (chunks of several prompts packed
    into the decode rows' forward: each token at its own position), one of them extending a
    prompt the prefix cache holds: each output equals that prompt alone."""
    _, model, tokenizer, _, _ = gpt2
    rng = random.Random(1)
    base = [rng.randrange(3, 256) for _ in range(200)]
    prompts = [base + [rng.randrange(3, 256) for _ in range(40)], [rng.randrange(3, 256) for _ in range(300)],
               [rng.randrange(3, 256) for _ in range(5)], [rng.randrange(3, 256) for _ in range(90)]]
    requests = [GenerationRequest(p, max_tokens=6 + i) for i, p in enumerate(prompts)]

    def alone(request: GenerationRequest) -> list[int]:
        return [r.token for r in stream_generate(model, tokenizer, request.prompt_ids, request.max_tokens,
                                                 prefill_step_size=CHUNK)]

    with Engine(model, tokenizer, prefill_chunk=CHUNK, step_tokens=3 * CHUNK) as engine:
        first = GenerationRequest(base, max_tokens=2)
        assert [e.token for e in engine.submit(first) if e.token is not None] == alone(first)
        events = [list(h) for h in [engine.submit(r) for r in requests]]
    replies = [[e.token for e in got if e.token is not None] for got in events]
    assert replies == [alone(request) for request in requests]
    assert len({t for reply in replies for t in reply}) > 10  # replies that a wrong position changes
    assert events[0][-1].cached_tokens > 0  # the first prompt's prefix came from the prefix cache


def test_requests_end_at_the_learned_positions(gpt2):
    """A prompt plus ``max_tokens`` filling every position decodes, and one token more (the last
    token is never fed back; speculation's drafts too, alone and in the engine); one more
    position is a clear error from ``stream_generate``, the engine and the model itself (not a
    read past the position table)."""
    from mlxformer.speculative.speculator import SpeculativeSettings

    _, model, tokenizer, hf_model, _ = gpt2
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, 12, size=POSITIONS - 12)]  # repetitive: drafts
    lookup = SpeculativeSettings(prompt_lookup=True, num_draft_tokens=4, ngram_min=1)
    plain = [r.token for r in stream_generate(model, tokenizer, prompt, 13)]
    speculated = list(stream_generate(model, tokenizer, prompt, 13, speculative=lookup))
    assert [r.token for r in speculated] == plain and speculated[-1].proposed_tokens > 0
    message = f"need {POSITIONS + 1} positions; this model has {POSITIONS}"
    with Engine(model, tokenizer, speculative=lookup) as engine:
        assert [e.token for e in engine.submit(GenerationRequest(prompt, 13)) if e.token is not None] == plain
        with pytest.raises(MlxformerError, match=message):
            engine.submit(GenerationRequest(prompt, 14))
    with pytest.raises(MlxformerError, match=message):
        next(stream_generate(model, tokenizer, prompt, 14))
    # a prompt of every position gets its one token (what a completion scoring its prompt runs)
    whole = [int(t) for t in tokens(POSITIONS, seed=5)]
    with torch.no_grad():
        expected = int(hf_model(torch.tensor([whole])).logits[0, -1].argmax())
    assert [r.token for r in stream_generate(model, tokenizer, whole, 1)] == [expected]
    with pytest.raises(MlxformerError, match=f"past this model's {POSITIONS} learned positions"):
        model(mx.zeros((1, POSITIONS + 1), dtype=mx.int32))


@pytest.fixture(scope="module")
def hub_style(gpt2, tmp_path_factory):
    """The checkpoint as the hub's ``gpt2`` stores it: names without ``transformer.``, each
    layer's causal-mask buffer ``h.N.attn.bias`` (what mlx-lm's ``gpt2`` reads) and a config
    without ``tie_word_embeddings`` (transformers' default: tied)."""
    from safetensors.numpy import load_file, save_file

    directory = gpt2[0]
    out = tmp_path_factory.mktemp("gpt2_hub_style")
    weights = {k.removeprefix("transformer."): v for k, v in load_file(directory / "model.safetensors").items()}
    weights.update({f"h.{i}.attn.bias": np.tril(np.ones((1, 1, 8, 8), dtype=np.float32)) for i in range(2)})
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config.pop("tie_word_embeddings", None)
    (out / "config.json").write_text(json.dumps(config))
    write_byte_tokenizer(out)
    return out


def test_hub_names_and_mask_buffers_load(gpt2, hub_style):
    model, _ = load(hub_style, dtype=mx.float32)
    assert max_diff(np.array(model(mx.array(tokens(SEQ_LEN)[None]))[0]), gpt2[-1]) <= BOUND


def test_untied_output_layer(tmp_path):
    """``tie_word_embeddings: false``: the checkpoint's own ``lm_head`` (read as a base model's
    hidden states before: ``GPT2LMHeadModel`` ends with ``Model``)."""
    hf_model = tiny_gpt2(tmp_path, seed=4, tie_word_embeddings=False)
    write_byte_tokenizer(tmp_path)
    model, _ = load(tmp_path, dtype=mx.float32)
    assert not model.args.tie_word_embeddings
    got = np.array(model(mx.array(tokens(SEQ_LEN)[None]))[0])
    assert max_diff(got, hf_logits(hf_model, tokens(SEQ_LEN))) <= BOUND


def _mlx_lm_logits(directory) -> np.ndarray:
    """mlx-lm's float32 logits of ``tokens(SEQ_LEN)`` on the model in ``directory``."""
    from mlx_lm.utils import load_model

    theirs, _ = load_model(directory)
    theirs.set_dtype(mx.float32)  # float16 scales and activations otherwise; ours are float32
    return np.array(theirs(mx.array(tokens(SEQ_LEN)[None]))[0].astype(mx.float32))


def test_converted_dir_loads_in_mlx_lm_and_back(gpt2, tmp_path):
    """``convert`` writes mlx-lm's GPT-2 layout (``model.h.N.attn.c_attn``, transposed once, its
    config keys): mlx-lm's ``gpt2`` and mlxformer both read it with transformers' logits; 8-bit
    too, the position table quantized like the token table, mlx-lm's logits equal ours (on this
    chaotic random model 8-bit rounding alone moves log-probs by 0.6 from transformers')."""
    directory, _, _, _, ref = gpt2
    ids = mx.array(tokens(SEQ_LEN)[None])
    out = convert(directory, tmp_path / "float", progress=False)
    assert "model.h.1.attn.c_attn.weight" in (out / "model.safetensors").read_bytes()[:4096].decode("latin-1")
    model, _ = load(out, dtype=mx.float32)
    assert max_diff(np.array(model(ids)[0]), ref) <= BOUND
    assert max_diff(_mlx_lm_logits(out), ref) <= BOUND
    out = convert(directory, tmp_path / "q8", quantize=True, q_bits=8, quant_recipe="mixed", progress=False)
    model, _ = load(out, dtype=mx.float32)
    assert isinstance(model.model.embed_positions, nn.QuantizedEmbedding)
    got = np.array(model(ids)[0])
    assert max_diff(got, _mlx_lm_logits(out)) <= BOUND
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_mlx_lm_conversion_loads(gpt2, hub_style, tmp_path):
    """A GPT-2 converted by mlx-lm itself (mlx-community's layout: ``model.h.N``, Linear weights),
    float and 4-bit, loads with mlx-lm's logits."""
    import mlx_lm

    ref = gpt2[-1]
    for quantize in (False, True):
        out = tmp_path / f"mlx_lm{int(quantize)}"
        mlx_lm.convert(str(hub_style), str(out), quantize=quantize, dtype="float32")
        model, _ = load(out, dtype=mx.float32)
        got = np.array(model(mx.array(tokens(SEQ_LEN)[None]))[0])
        assert max_diff(got, _mlx_lm_logits(out)) <= BOUND
        if not quantize:
            assert max_diff(got, ref) <= BOUND


def test_llama_cpp_gguf_matches_transformers(tmp_path_factory, hf_smollm_tokenizer):
    """llama.cpp's ``convert_hf_to_gguf.py`` (its ``gpt2`` architecture: it transposes the
    ``Conv1D`` weights itself, writes ``position_embd`` and LayerNorm biases) on the tiny GPT-2
    with a byte-level BPE it knows (SmolLM2's): the GGUF's logits are transformers', and its
    vocabulary (tokenizer model ``gpt2``) encodes as the HF tokenizer does."""
    from test_gguf_families import run_converter

    root = tmp_path_factory.mktemp("gpt2_gguf")
    hf_model = tiny_gpt2(root / "hf", vocab_size=len(hf_smollm_tokenizer))
    hf_smollm_tokenizer.save_pretrained(root / "hf")
    path = root / "gpt2.gguf"
    errors = run_converter(root, [{"name": "gpt2", "argv": [str(root / "hf"), "--outtype", "f32", "--outfile", str(path)]}])
    assert errors["gpt2"] is None, errors["gpt2"]
    ids = tokens(SEQ_LEN)
    model, tokenizer = load(path, dtype=mx.float32)
    assert model.args.model_type == "gpt2" and model.args.tie_word_embeddings
    assert max_diff(np.array(model(mx.array(ids[None]))[0]), hf_logits(hf_model, ids)) <= BOUND
    assert footprint(path).parameters == sum(p.numel() for p in hf_model.parameters())  # ``info``'s count
    text = "Hello world, it's GPT-2 — in 2019!"
    assert tokenizer.encode(text) == hf_smollm_tokenizer.encode(text)
