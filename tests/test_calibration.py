"""Calibration statistics (the activation importance behind the default ``mixed`` recipe)
against transformers: forward pre-hooks on every linear layer of the float32 source model
record the same per-column mean squares that the converter computes stage by stage."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import write_byte_tokenizer, write_tiny_checkpoint
from mlxformer.tools.converter import _Job, _settings
from mlxformer.formats.checkpoint import open_checkpoint
from mlxformer.quant.calibration import CALIBRATION_TEXT


def transformers_importance(hf_model, ids: list[int], tied: bool) -> dict[str, np.ndarray]:
    """Mean squared input per column of every linear layer of the whole model in one forward."""
    import torch

    stats: dict[str, np.ndarray] = {}

    def hook(name):
        def record(module, inputs):
            x = inputs[0].detach().double().reshape(-1, inputs[0].shape[-1])  # (tokens, in)
            stats[name] = (x * x).mean(0).numpy()
        return record

    handles = [m.register_forward_pre_hook(hook("model.embed_tokens" if name == "lm_head" and tied else name))
               for name, m in hf_model.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        hf_model(torch.tensor([ids]))
    for handle in handles:
        handle.remove()
    return stats


@pytest.mark.parametrize("model_type,config", [
    ("llama", {"tie_word_embeddings": True}),
    ("qwen2", {"tie_word_embeddings": False}),  # attention biases, untied head
    ("gemma", {"tie_word_embeddings": True}),  # embeddings scaled by sqrt(hidden) before the first layer
])
def test_importance_matches_transformers_hooks(tmp_path, model_type, config):
    directory, hf_model = write_tiny_checkpoint(tmp_path, model_type, seed=4, **config)
    write_byte_tokenizer(directory)
    ids = [ord(c) for c in CALIBRATION_TEXT][:128]  # the byte tokenizer's ids, computed independently
    job = _Job(open_checkpoint(directory), _settings(True, None, None, None, "mixed", False, False))
    expected = transformers_importance(hf_model, ids, config["tie_word_embeddings"])
    assert set(job.importance) == set(expected) and len(expected) == 2 * 7 + 1
    for path, values in expected.items():
        np.testing.assert_allclose(np.array(job.importance[path]), values, rtol=2e-5, atol=1e-7, err_msg=path)
