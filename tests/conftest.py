"""Shared fixtures: the real SmolLM2 GGUF, its transformers reference, an HF-layout copy of it,
and a writer of tiny random checkpoints saved by transformers itself."""

from __future__ import annotations

import copy
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the hub from tests
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

TINY_SHAPE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
)


@contextmanager
def cpu_default_device():
    """Make the CPU MLX's default device for the block, then restore the previous default:
    tests of CPU-only policies (row sharding, the CPU dtype and prefill policies) must not
    depend on the machine having no GPU."""
    import mlx.core as mx

    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        yield
    finally:
        mx.set_default_device(previous)


@pytest.fixture
def cpu_device():
    """The CPU as MLX's default device for one test (see ``cpu_default_device``)."""
    with cpu_default_device():
        yield


@pytest.fixture(scope="module")
def cpu_module():
    """The CPU as MLX's default device for every test of a module (``pytestmark``), module-scoped
    fixtures included."""
    with cpu_default_device():
        yield


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF (the offline default model)."""
    from mlxformer.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_smollm(smollm_gguf: Path):
    """transformers' float32 model from the GGUF (weights dequantized by transformers; converted
    once and kept on disk, see ``hf_reference_cache``)."""
    from hf_reference_cache import hf_model_from_gguf

    return hf_model_from_gguf(smollm_gguf)


@pytest.fixture(scope="session")
def hf_smollm_tokenizer(smollm_gguf: Path):
    """transformers' tokenizer from the GGUF (converted once and kept on disk)."""
    from hf_reference_cache import hf_tokenizer_from_gguf

    return hf_tokenizer_from_gguf(smollm_gguf)


@pytest.fixture(scope="session")
def smollm_hf_dir(hf_smollm, hf_smollm_tokenizer, tmp_path_factory) -> Path:
    """The GGUF model in HF layout: bfloat16 safetensors + tokenizer files, written by transformers."""
    import torch

    directory = tmp_path_factory.mktemp("smollm_hf")
    copy.deepcopy(hf_smollm).to(torch.bfloat16).save_pretrained(directory)
    hf_smollm_tokenizer.save_pretrained(directory)
    return directory


def log_softmax(x):
    """Log-probabilities of logits ``(..., vocab)`` in float64 (numpy)."""
    import numpy as np

    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def max_diff(ours, ref) -> float:
    """Largest log-probability difference between two logits arrays."""
    import numpy as np

    return float(np.abs(log_softmax(ours) - log_softmax(ref)).max())


def perturb_(model, seed: int = 0) -> None:
    """Give every parameter O(1)-scale random values in place, so the logits are far from uniform
    and every weight (norm scales, biases) visibly changes the output. transformers' default
    init (std 0.02, unit norms, zero biases) would make a wrong mapping hard to see."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                param.copy_(0.3 * noise)  # also the tied lm_head: logits of O(1-3)
            else:  # (out, in) projections: unit-variance outputs, times a bit more for peaked softmaxes
                param.copy_(1.5 * noise / param.shape[-1] ** 0.5)


def write_tiny_checkpoint(
    directory: Path, model_type: str, seed: int = 0, model_class: Any = None, **config: Any
) -> tuple[Path, Any]:
    """Save a tiny random transformers model of ``model_type`` (``TINY_SHAPE`` plus ``config``)
    with ``save_pretrained`` into ``directory``; returns ``(directory, float32 eager HF model)``.
    ``model_class``: the transformers auto class (default ``AutoModelForCausalLM``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(model_type, **{**TINY_SHAPE, **config})
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = (model_class or AutoModelForCausalLM).from_config(hf_config, dtype=torch.float32)
    perturb_(model, seed)
    model.eval()
    model.save_pretrained(directory)
    return directory, model


def tiny_byte_llama_of(directory: Path, layers: int):
    """A tiny random Llama of ``layers`` layers (head size 32) with the byte tokenizer and no
    end-of-sequence token, loaded in float32: (model, tokenizer)."""
    import mlx.core as mx

    from mlxformer import load

    directory, _ = write_tiny_checkpoint(directory, "llama", head_dim=32, num_hidden_layers=layers,
                                         max_position_embeddings=1024)
    write_byte_tokenizer(directory)
    model, tokenizer = load(directory, dtype=mx.float32)
    tokenizer.eos_token_ids = []
    return model, tokenizer


def write_byte_tokenizer(directory: Path) -> None:
    """A ``tokenizer.json`` mapping each Latin-1 character to its code (ids 0..255), made with
    ``tokenizers``: any text of those characters encodes, within a 256-token vocabulary."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE(vocab={chr(i): i for i in range(256)}, merges=[])).save(str(directory / "tokenizer.json"))


def write_tiny_byte_llama(directory: Path, seed: int = 0) -> Path:
    """A tiny random Llama (head_dim 32, so quantized KV groups of 32 fit) with the byte tokenizer."""
    write_tiny_checkpoint(directory, "llama", seed=seed, head_dim=32, hidden_size=128,
                          num_attention_heads=4, num_key_value_heads=2)
    write_byte_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_byte_llama(tmp_path_factory):
    """``write_tiny_byte_llama`` loaded in float32: (model, tokenizer)."""
    import mlx.core as mx

    from mlxformer import load

    return load(write_tiny_byte_llama(tmp_path_factory.mktemp("tiny_byte_llama")), dtype=mx.float32)


def edit_config(directory: Path, **changes: Any) -> dict[str, Any]:
    """Rewrite ``directory/config.json`` with ``changes`` (a ``None`` value deletes the key)."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config, indent=2))
    return config


def add_mlx_lm_config_keys(directory: Path) -> dict[str, Any]:
    """Give a transformers-5 ``config.json`` the transformers-4 keys that mlx-lm's model classes
    read (and that real mlx-community configs carry): ``rope_theta``/``rope_scaling``
    (``rope_local_base_freq`` for Gemma 3's per-layer-type ``rope_parameters``),
    ``partial_rotary_factor`` and ``num_experts`` at the top level; and a ``tokenizer_config.json``
    naming the plain fast tokenizer (mlx-lm loads ``AutoTokenizer``, whose per-family classes
    expect special tokens the byte tokenizer lacks)."""
    config = edit_config(directory)
    params = dict(config.get("rope_parameters") or {})
    changes: dict[str, Any] = {}
    if isinstance(params.get("full_attention"), dict):  # Gemma 3: keyed by layer type
        changes["rope_local_base_freq"] = params.get("sliding_attention", {}).get("rope_theta", 10000.0)
        params = dict(params["full_attention"])
    if "partial_rotary_factor" in params:
        changes["partial_rotary_factor"] = params.pop("partial_rotary_factor")
    changes["rope_theta"] = params.pop("rope_theta", 10000.0)
    if params.get("rope_type", "default") != "default":
        changes["rope_scaling"] = {**params, "type": params["rope_type"]}
    if config.get("num_local_experts") and not config.get("num_experts"):
        changes["num_experts"] = config["num_local_experts"]
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return edit_config(directory, **changes)


@pytest.fixture(scope="session")
def smollm(smollm_gguf: Path):
    """mlxformer's ``load`` of the real GGUF: (model, tokenizer), float32 compute (CPU policy),
    projections split over 2 CPU streams whatever the machine's core count, so the sharded
    quantized path is what the transformers-parity tests check."""
    from mlxformer import load

    with cpu_default_device():
        return load(smollm_gguf, threads=2)


@pytest.fixture(scope="session")
def tiny_smol(tmp_path_factory, hf_smollm_tokenizer):
    """A 2-layer random llama over SmolLM2's real tokenizer and chat template (8192-token context,
    like SmolLM2's), saved with transformers: ``(directory, transformers model)``. Decoding costs
    milliseconds, so server tests on it measure the server."""
    directory = tmp_path_factory.mktemp("tiny_smol")
    _, hf_model = write_tiny_checkpoint(directory, "llama", vocab_size=len(hf_smollm_tokenizer),
                                        max_position_embeddings=8192, tie_word_embeddings=True)
    hf_smollm_tokenizer.save_pretrained(directory)
    return directory, hf_model
