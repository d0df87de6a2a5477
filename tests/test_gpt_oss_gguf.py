"""gpt-oss as GGUF: what llama.cpp's ``convert_hf_to_gguf.py`` writes from the tiny checkpoint,
float (``--outtype f32``) and from the MXFP4-published one (its experts become GGUF's MXFP4
tensor type, which loads as MLX ``mxfp4`` with integer moves only), against transformers'
logits (on the dequantized reference for MXFP4)."""

from __future__ import annotations


import mlx.core as mx
import numpy as np
import pytest
import torch

from conftest import cpu_default_device, max_diff
from mlxformer import load
from mlxformer.formats.gguf_reader import read_gguf
from mlxformer.models.moe import QuantizedSwitchLinear
from test_gguf_families import run_converter
from test_gpt_oss import BOUND, SEQ_LEN, reference, tokens, write_gpt_oss
from test_gpt_oss_mxfp4 import to_mxfp4_checkpoint


@pytest.fixture(scope="module")
def converted(tmp_path_factory, hf_smollm_tokenizer):
    """name -> (transformers model, GGUF path): "f32" and "mxfp4"."""
    root = tmp_path_factory.mktemp("gpt_oss_gguf")
    models, jobs = {}, []
    with cpu_default_device():
        for name in ("f32", "mxfp4"):
            directory, models[name] = write_gpt_oss(root / name, vocab_size=len(hf_smollm_tokenizer))
            hf_smollm_tokenizer.save_pretrained(directory)
            if name == "mxfp4":
                to_mxfp4_checkpoint(directory, models[name])
            jobs.append({"name": name, "argv": [str(directory), "--outtype", "f32", "--outfile", str(root / f"{name}.gguf")]})
    errors = run_converter(root, jobs)
    assert errors == {"f32": None, "mxfp4": None}, errors
    return {name: (models[name], root / f"{name}.gguf") for name in models}


@pytest.mark.parametrize("name", ["f32", "mxfp4"])
def test_converter_gguf_matches_transformers(converted, name):
    hf_model, path = converted[name]
    types = {info.type_name for n, info in read_gguf(path).tensors.items() if "_exps" in n and n.endswith(".weight")}
    assert types == ({"MXFP4"} if name == "mxfp4" else {"F32"})
    ids = tokens(SEQ_LEN)
    with cpu_default_device():
        model, _ = load(path, dtype=mx.float32, threads=1)
        got = np.array(model(mx.array(ids[None]))[0])
    experts = model.layers[0].mlp.experts
    assert isinstance(experts.down_proj, QuantizedSwitchLinear) == (name == "mxfp4")
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids[None])).logits[0].numpy()
    assert max_diff(got, ref) <= BOUND
