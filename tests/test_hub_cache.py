"""Loading by Hugging Face repo id goes through huggingface_hub for real, here against an
offline HF cache laid out as the hub client writes it (no network is touched)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import write_tiny_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "tinyorg/tiny-llama"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, smollm):
    """An HF cache holding ``REPO`` at ``COMMIT``: a tiny Llama with SmolLM2's tokenizer."""
    source, hf_model = write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_src"), "llama", vocab_size=49152, tie_word_embeddings=True
    )
    smollm[1].save(source)
    cache = tmp_path_factory.mktemp("hf_cache")
    repo_dir = cache / f"models--{REPO.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for file in source.iterdir():
        shutil.copy(file, snapshot / file.name)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(COMMIT)
    return cache, hf_model


def run_offline(cache: Path, code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_repo_id_loads_from_offline_cache(hub_cache):
    cache, hf_model = hub_cache
    ids = [1, 17, 300, 4000, 12, 9, 49151, 5]
    code = (
        "import json, mlx.core as mx\n"
        "from mlxformer import load\n"
        f"model, tok = load({REPO!r})\n"
        "model.set_dtype(mx.float32)\n"
        f"logits = model(mx.array([{ids}]))\n"
        "print(json.dumps(logits[0].tolist()))\n"
    )
    result = run_offline(cache, code)
    assert result.returncode == 0, result.stderr
    ours = np.array(json.loads(result.stdout.strip().splitlines()[-1]))
    with torch.no_grad():
        reference = hf_model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(ours - reference).max() < 1e-3


def test_uncached_repo_offline_is_one_line_error(hub_cache):
    cache, _ = hub_cache
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        ["mlxformer", "generate", "--model", "tinyorg/not-there", "--prompt", "hi"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlxformer: error:") and "tinyorg/not-there" in lines[0]


def test_repo_with_a_consolidated_copy_loads_only_the_hf_weights(hub_cache):
    """Issue 18: a Mistral-style repo also holds ``consolidated.safetensors`` (the same weights
    under Mistral's names); it is neither fetched nor merged into the HF weights."""
    from safetensors.numpy import save_file

    cache, _ = hub_cache
    source = cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    repo_dir = cache / "models--tinyorg--tiny-mistral-layout"
    shutil.copytree(source, repo_dir / "snapshots" / COMMIT)
    save_file({"layers.0.attention.wq.weight": np.zeros((64, 64), np.float32)},
              str(repo_dir / "snapshots" / COMMIT / "consolidated.safetensors"))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(COMMIT)
    code = ("from mlxformer.formats.checkpoint import open_checkpoint\n"
            "c = open_checkpoint('tinyorg/tiny-mistral-layout')\n"
            "print(sorted({e.file.name for e in c.tensors.entries.values()}))\n")
    result = run_offline(cache, code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "['model.safetensors']"
