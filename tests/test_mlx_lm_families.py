"""mlx-lm interop of every family, on the tiny random checkpoints of tests/test_families.py and
tests/test_moe.py: mlx-lm's own ``convert`` of each (float, and 4-bit as mlx-community dirs are
made) loads in mlxformer with mlx-lm's logits, and what ``mlxformer convert`` writes (float and
``-q``) loads in mlx-lm with equal logits. Float dirs are also checked against transformers on
the original checkpoint, so a shared mistake could not pass. ``mlxformer info``'s figures for
each family are checked against transformers' parameters and the files' bytes.

Where mlx-lm itself departs from transformers the prompt stays where it does not (and the Ministral 3
case has no window: mlx-lm slides only the layers its ``layer_types`` names): mlx-lm's
Gemma 2 and Phi-3 have no sliding window (8 tokens, one window), its Phi-3 LongRoPE always uses
the long factors (40 tokens, past the 32-token switch), its Gemma uses exact GELU where
transformers and mlxformer use the tanh approximation (a looser bound). mlx-lm's Qwen2-MoE
has no dense layers among the sparse ones (``mlp_only_layers``: it refuses their weights), so
that case has none here.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten

import test_families
import test_moe
from conftest import add_mlx_lm_config_keys, max_diff, write_byte_tokenizer, write_tiny_checkpoint
from mlxformer import convert, load

BOUND = 1e-4  # the same MLX ops on both sides (measured <= 3e-6)
HF_BOUND = 3e-4  # float32 against transformers (as tests/test_families.py)
# name -> (model_type, overrides, prompt length, bound against mlx-lm)
CASES = {
    **{name: (model_type, overrides, 40, BOUND) for name, (model_type, overrides) in test_families.CASES.items()},
    **{name: (name, overrides, 80, BOUND) for name, overrides in test_moe.CASES.items()},  # 80: the sorted gather
}
CASES["gemma"] = (*CASES["gemma"][:3], 0.02)  # mlx-lm's exact GELU (measured 0.009 float, 0.017 4-bit)
CASES["gemma2"] = (*CASES["gemma2"][:2], 8, BOUND)
CASES["phi3"] = (*CASES["phi3"][:2], 8, BOUND)
CASES["qwen2_moe"] = ("qwen2_moe", {**test_moe.CASES["qwen2_moe"], "mlp_only_layers": []}, 80, BOUND)
# mlx-lm's Ministral 3 slides only layers that ``layer_types`` names, and needs one full layer among them
# (transformers slides every layer and ignores ``layer_types``): no window here (YaRN and the query
# scaling past 16 positions still are)
CASES["ministral3"] = ("ministral3", {**test_families.CASES["ministral3"][1], "sliding_window": None}, 40, BOUND)


pytestmark = pytest.mark.usefixtures("cpu_module")


@pytest.fixture(scope="module", params=list(CASES))
def dirs(request, tmp_path_factory):
    """``(name, transformers model, root)``: ``root/hf`` the tiny checkpoint, ``root/mlx-lm``
    and ``root/mlx-lm-q4`` mlx-lm's conversions of it, ``root/ours`` and ``root/ours-q4`` ours."""
    from mlx_lm import convert as mlx_lm_convert

    name = request.param
    model_type, overrides, _, _ = CASES[name]
    root = tmp_path_factory.mktemp(name)
    source, hf_model = write_tiny_checkpoint(root / "hf", model_type, **overrides)
    write_byte_tokenizer(source)
    add_mlx_lm_config_keys(source)
    quantize = dict(quantize=True, q_group_size=32, q_bits=4)
    mlx_lm_convert(str(source), str(root / "mlx-lm"))
    mlx_lm_convert(str(source), str(root / "mlx-lm-q4"), **quantize)
    convert(source, root / "ours")
    convert(source, root / "ours-q4", **quantize)
    return name, hf_model, root


def test_mlx_lm_dirs_both_ways(dirs):
    from mlx_lm import load as mlx_lm_load

    name, hf_model, root = dirs
    _, _, length, bound = CASES[name]
    ids = np.random.default_rng(1).integers(3, 256, size=length)
    with torch.no_grad():
        reference = hf_model(torch.tensor(ids[None])).logits[0].numpy()
    for directory in ("mlx-lm", "mlx-lm-q4", "ours", "ours-q4"):
        theirs, _ = mlx_lm_load(str(root / directory))
        theirs.set_dtype(mx.float32)  # float32 activations on both sides; scales widen exactly
        ours, _ = load(root / directory, dtype=mx.float32, threads=1)
        got = np.array(ours(mx.array(ids[None]))[0])
        assert max_diff(got, np.array(theirs(mx.array(ids[None]))[0])) <= bound, directory
        if directory.endswith("q4"):
            quantized = "switch_mlp.down_proj.scales" if name in test_moe.CASES else "mlp.down_proj.scales"
            assert any(n.endswith(quantized) for n, _ in tree_flatten(ours.parameters())), directory
            assert json.loads((root / directory / "config.json").read_text())["quantization"]["bits"] == 4
        else:
            assert max_diff(got, reference) <= HF_BOUND, directory


def file_bytes(directory) -> int:
    """Bytes of every tensor in ``directory``'s safetensors files, from their headers (safetensors')."""
    from safetensors import safe_open

    sizes = {"F32": 4, "U32": 4, "F16": 2, "BF16": 2}
    total = 0
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), "np") as f:
            for key in f.keys():
                tensor = f.get_slice(key)
                total += int(np.prod(tensor.get_shape())) * sizes[tensor.get_dtype()]
    return total


def test_info_figures(dirs):
    """``mlxformer info``'s figures against transformers' own modules and the files: every
    parameter (tied embeddings once; quantized ones unpacked), per token the routed experts'
    share ``k / experts``, and the stored bytes, float and 4-bit."""
    from mlxformer.tools.planning import footprint

    name, hf_model, root = dirs
    total = sum(p.numel() for p in hf_model.parameters())
    routed = sum(p.numel() for n, p in hf_model.named_parameters() if ".experts." in n)
    for directory in ("hf", "mlx-lm-q4"):
        fp = footprint(root / directory)
        args = fp.args
        assert fp.parameters == total, directory
        active = total - routed + (routed * args.num_experts_per_tok // args.num_experts if routed else 0)
        assert fp.active_parameters == active and (active < total) == (name in test_moe.CASES), directory
        assert fp.stored_bytes == file_bytes(root / directory), directory
