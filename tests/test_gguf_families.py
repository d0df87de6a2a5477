"""GGUF files written by llama.cpp's own ``convert_hf_to_gguf.py`` (llama-cpp-python's sdist)
from tiny random transformers checkpoints of every family, loaded by mlxformer and compared
with transformers' logits on the original checkpoint: one 40-token forward per family (past
the sliding windows of 8, past Phi-4-mini's 32-token LongRoPE switch).

The converter runs once, in one subprocess, for all families (``convert_driver.py``). Its
tokenizer step needs a tokenizer it accepts: a tiny SentencePiece model for the families it
reads with SentencePiece, SmolLM2's real tokenizer (a BPE whose hash llama.cpp knows) for those
it only reads as GPT-2 BPE. The checkpoints keep the settings llama.cpp hard-codes rather than
writing (Gemma 2/3's attention scale 1/sqrt(head_dim), SmolLM3's no-RoPE interval 4, no dense
layers among Qwen2-MoE's sparse ones): the file cannot say otherwise.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

import test_families
import test_moe
from agent_support import LLAMA_CPP_PYTHON_VERSION
from conftest import cpu_default_device, max_diff, write_tiny_checkpoint
from hf_reference_cache import cache_root
from mlxformer import convert, load
from mlxformer.models.moe import QuantizedSwitchLinear, SparseMoE
from mlxformer.tools.planning import footprint

CACHE = cache_root()
CONVERTER = CACHE / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
DRIVER = Path(__file__).with_name("convert_driver.py")


def run_converter(root: Path, jobs: list[dict]) -> dict[str, str | None]:
    """Run llama.cpp's converter on each job (``name``, ``argv``) in one subprocess; each name's
    error (None when it wrote its file)."""
    if not CONVERTER.is_file():
        pytest.fail(f"{CONVERTER} is missing: run scripts/install_test_deps.sh")
    (root / "jobs.json").write_text(json.dumps(jobs))
    done = subprocess.run([sys.executable, str(DRIVER), str(CONVERTER), str(root / "jobs.json"), str(root / "out.jsonl")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["name"]: r["error"] for r in map(json.loads, (root / "out.jsonl").read_text().splitlines())}
SEQ_LEN = 40
BOUND = 3e-4  # float32 on both sides (measured <= 3e-5)
# The converter reads these families' vocabularies only as GPT-2 BPE, which it accepts only
# when it knows the tokenizer's hash.
BPE_FAMILIES = ("olmo2", "olmo3", "qwen2_moe", "qwen3_moe", "olmoe")
# name -> (model_type, transformers config overrides, converter --outtype)
CASES = {
    "gemma": (*test_families.CASES["gemma"], "f32"),
    # llama.cpp's attention scale is 1/sqrt(head_dim) (query_pre_attn_scalar is not written)
    "gemma2": ("gemma2", {**test_families.CASES["gemma2"][1], "query_pre_attn_scalar": 32}, "f32"),
    # a local RoPE base of 20k: read from rope.freq_base_swa, not llama.cpp's default 10k
    "gemma3": ("gemma3_text", {**test_families.CASES["gemma3"][1], "query_pre_attn_scalar": 32, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 2e4},
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}}}, "f32"),
    "phi3": (*test_families.CASES["phi3"], "f32"),
    "phi4mini-longrope": (*test_families.CASES["phi4mini-longrope"], "f32"),
    "granite": (*test_families.CASES["granite"], "f32"),
    "olmo2": (*test_families.CASES["olmo2"], "f32"),
    "olmo3": (*test_families.CASES["olmo3"], "f32"),  # written as olmo2 with a window and its layer pattern
    # mistral3: YaRN and the query scaling's beta (attention.temperature_scale); no window key is written
    # (llama.cpp's mistral3 has none, nor have the released Ministral 3 configs)
    "ministral3": ("ministral3", {**test_families.CASES["ministral3"][1], "sliding_window": None}, "f32"),
    # llama.cpp: every fourth layer without RoPE
    "smollm3": ("smollm3", {**test_families.CASES["smollm3"][1], "no_rope_layer_interval": 4,
                            "num_hidden_layers": 4}, "f32"),
    "mixtral": ("mixtral", test_moe.CASES["mixtral"], "f32"),
    "mixtral-q8_0": ("mixtral", test_moe.CASES["mixtral"], "q8_0"),  # quantized 3-D experts
    # llama.cpp's qwen2moe has no dense layers among the sparse ones
    "qwen2_moe": ("qwen2_moe", {**test_moe.CASES["qwen2_moe"], "mlp_only_layers": []}, "f32"),
    "qwen3_moe": ("qwen3_moe", test_moe.CASES["qwen3_moe"], "f32"),
    "olmoe": ("olmoe", test_moe.CASES["olmoe"], "f32"),
}


def write_spm_tokenizer(directory: Path) -> None:
    """A tiny SentencePiece BPE ``tokenizer.model`` (< 256 pieces, within the tiny vocabulary)."""
    import sentencepiece as spm

    rng = random.Random(0)
    words = "the of and a to in is you that it he was for on are as with his they at be this from".split()
    corpus = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) for _ in range(300)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_prefix=str(directory / "tokenizer"),
                                   vocab_size=256, hard_vocab_limit=False, model_type="bpe", minloglevel=2)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, hf_smollm_tokenizer):
    """name -> (transformers model, GGUF path or None, the converter's error or None)."""
    root = tmp_path_factory.mktemp("gguf_families")
    spm_dir = root / "spm"
    spm_dir.mkdir()
    write_spm_tokenizer(spm_dir)
    models, jobs = {}, []
    for name, (model_type, overrides, outtype) in CASES.items():
        bpe = model_type in BPE_FAMILIES
        vocab = {"vocab_size": len(hf_smollm_tokenizer)} if bpe else {}
        directory, models[name] = write_tiny_checkpoint(root / name, model_type, **overrides, **vocab)
        if bpe:
            hf_smollm_tokenizer.save_pretrained(directory)
        else:
            shutil.copy(spm_dir / "tokenizer.model", directory)
        jobs.append({"name": name, "argv": [str(directory), "--outtype", outtype, "--outfile", str(root / f"{name}.gguf")]})
    errors = run_converter(root, jobs)
    return {name: (models[name], root / f"{name}.gguf", errors[name]) for name in CASES}


def q8_0_rounded(hf_model):
    """A copy of ``hf_model`` whose matrices went through gguf-py's Q8_0 quantize/dequantize, as
    the converter's ``--outtype q8_0`` stores them (every matrix but the router)."""
    from gguf import GGMLQuantizationType, quants

    rounded = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, param in rounded.named_parameters():
            if param.ndim >= 2 and not name.endswith("mlp.gate.weight"):  # (experts,) out, in
                values = quants.quantize(param.numpy(), GGMLQuantizationType.Q8_0)
                param.copy_(torch.from_numpy(quants.dequantize(values, GGMLQuantizationType.Q8_0)))
    return rounded


@pytest.mark.parametrize("name", list(CASES))
def test_converter_gguf_matches_transformers(converted, name):
    """Q8_0: against transformers on the same rounded weights (the rounding alone moves these
    random models' log-probs by 2)."""
    hf_model, path, error = converted[name]
    assert error is None, f"llama.cpp's converter failed on {name}: {error}"
    ids = np.random.default_rng(1).integers(3, 256, size=SEQ_LEN)
    if name.endswith("q8_0"):
        hf_model = q8_0_rounded(hf_model)
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids[None])).logits[0].numpy()
    with cpu_default_device():
        model, _ = load(path, dtype=mx.float32)
        got = np.array(model(mx.array(ids[None]))[0])
    assert max_diff(got, ref) <= BOUND
    assert footprint(path).parameters == sum(p.numel() for p in hf_model.parameters())  # ``info``'s count
    if model.args.mlp_type == "moe":
        blocks = [layer[layer.mlp_name] for layer in model.layers]
        assert all(isinstance(b, SparseMoE) for b in blocks)
        assert all(isinstance(b.switch_mlp.down_proj, QuantizedSwitchLinear) for b in blocks) == name.endswith("q8_0")


# Prompt length and bound per case where mlx-lm departs from transformers (tests/test_mlx_lm_families.py):
# no sliding window in its Gemma 2 and Phi-3, exact GELU in its Gemma.
MLX_LM_LENGTH = {"gemma2": 8, "phi3": 8}
MLX_LM_BOUND = {"gemma": 0.02}


@pytest.mark.parametrize("name", list(CASES))
def test_converted_gguf_loads_in_mlx_lm(converted, name, tmp_path):
    """``mlxformer convert`` of each llama.cpp-written GGUF writes the normalized config, which
    mlx-lm reads with mlxformer's logits on the GGUF (before: Phi-3 LongRoPE failed with
    "rope_scaling must contain keys {'type','long_factor'}", Qwen3-MoE with "missing
    decoder_sparse_step and mlp_only_layers")."""
    from mlx_lm import load as mlx_lm_load

    _, path, error = converted[name]
    assert error is None, error
    convert(path, tmp_path / "mlx", progress=False)
    ids = mx.array(np.random.default_rng(1).integers(3, 256, size=MLX_LM_LENGTH.get(name, SEQ_LEN))[None])
    with cpu_default_device():
        ours, _ = load(path, dtype=mx.float32)
        theirs, _ = mlx_lm_load(str(tmp_path / "mlx"))
        theirs.set_dtype(mx.float32)
        assert max_diff(np.array(theirs(ids)[0]), np.array(ours(ids)[0])) <= MLX_LM_BOUND.get(name, 1e-4)
