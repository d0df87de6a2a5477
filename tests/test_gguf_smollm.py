"""SmolLM2-135M as llama.cpp's Q4_K_M, Q5_K_M, Q6_K, Q8_0 and Q4_0 mixes, made by the test's
quantizer from one float source (the shipped GGUF, dequantized by gguf-py), with the per-tensor
type choices llama.cpp makes for 576-wide rows (K-quants need multiples of 256, so most tensors
fall back to Q5_0/Q5_1/Q8_0; ``ffn_down``, 1536 wide, gets the K types).

Reference: transformers loading the same file (it dequantizes through gguf-py) in float32.
The vocabulary is left out of these files (gguf-py's reader spends most of transformers' load
time parsing it); token ids come from the shipped file's tokenizer.
"""

from __future__ import annotations

import collections

import gguf
import mlx.core as mx
import numpy as np
import pytest
import torch

from gguf_helpers import FloatSource, requantize_gguf
from mlxformer.tools.bench import mlxformer_loop
from mlxformer.loader import apply_dtype_policy, build_model, read_checkpoint

MIXES = ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0"]
PROMPTS = ["The capital of France is", "def fibonacci(n):"]  # prose and code (a third prompt added only time)
NEW_TOKENS = 8
# Exact mixes: identical float32 weights on both sides, only the summation order differs;
# measured max |logit difference| <= 2e-4 on logits of magnitude ~20.
EXACT_BOUND = 2e-3
# Q6_K (``ffn_down`` here) is requantized to 8 bits, group 32. Measured on the Q6_K file: max
# |logit difference| 0.51 (mean 0.096), a quarter of what Q6_K's own rounding moves the same
# logits (2.08: the Q6_K file against its Q8_0 sibling); the bound is half of the latter.
INEXACT_BOUND = 1.0


pytestmark = pytest.mark.usefixtures("cpu_device")  # CPU policies, whatever the default device


@pytest.fixture(scope="module", autouse=True)
def cached_tensor_name_map():
    """transformers rebuilds gguf-py's (pure, read-only) tensor name map once per module of the
    model while loading a GGUF (~70% of its load time for SmolLM2); build each one once."""
    import functools

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="module")
def float_source(smollm_gguf):
    return FloatSource(smollm_gguf)


@pytest.fixture(scope="module")
def prompt_ids(smollm):
    return [smollm[1].encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def variants(float_source, tmp_path_factory):
    directory = tmp_path_factory.mktemp("smollm_mixes")
    cache = {}

    def make(mix: str):
        if mix not in cache:
            path = directory / f"smollm-{mix}.gguf"
            types = requantize_gguf(float_source, path, mix, tokenizer=False)
            cache[mix] = (path, types)
        return cache[mix]

    return make


def _greedy_ours(model, ids: list[int]) -> list[int]:
    return list(mlxformer_loop(model)(mx.array(ids), NEW_TOKENS))


@pytest.mark.parametrize("mix", MIXES)
def test_smollm_mix_matches_transformers(mix, variants, prompt_ids):
    from transformers import AutoModelForCausalLM

    path, types = variants(mix)
    config, weights, _ = read_checkpoint(path)
    model = build_model(config, weights)
    apply_dtype_policy(model, None)  # CPU: float32 activations over the packed weights

    reader = gguf.GGUFReader(str(path))  # real tensors: one of each type, against gguf-py
    quant = config["quantization"]
    for tensor in {t.tensor_type: t for t in reader.tensors if t.name.startswith("blk.")}.values():
        if tensor.tensor_type == gguf.GGMLQuantizationType.F32 or "attn_q" in tensor.name or "attn_k" in tensor.name:
            continue
        module = "model.layers.{}.{}".format(tensor.name.split(".")[1], {
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
            "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}[tensor.name.split(".")[2]])
        spec = quant.get(module, quant)
        got = mx.dequantize(weights[f"{module}.weight"], weights[f"{module}.scales"].astype(mx.float32),
                            weights[f"{module}.biases"].astype(mx.float32), group_size=32, bits=spec["bits"])
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if tensor.tensor_type == gguf.GGMLQuantizationType.Q6_K:
            assert np.abs(np.array(got) - expected).max() <= np.abs(expected).max() / 255
        else:
            np.testing.assert_array_equal(np.array(got), expected)

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    bound = INEXACT_BOUND if "Q6_K" in {t.name for t in types.values()} else EXACT_BOUND
    for ids in prompt_ids:
        continuation = _greedy_ours(model, ids)
        sequence = ids + continuation[:-1]
        ours = np.array(model(mx.array([sequence]))[0].astype(mx.float32))
        with torch.no_grad():
            theirs = hf(torch.tensor([sequence])).logits[0].numpy()
        assert np.abs(ours - theirs).max() < bound
        # transformers' greedy choice at every generated position is ours: its greedy continuation equals ours
        assert theirs[len(ids) - 1 :].argmax(-1).tolist() == continuation


def test_mixes_have_llama_cpp_types(variants):
    """The Q4_K_M file mixes what llama.cpp writes for SmolLM2: Q5_0, Q4_K, Q6_K, Q8_0 and F32."""
    _, types = variants("Q4_K_M")
    assert set(collections.Counter(t.name for t in types.values())) == {"Q5_0", "Q4_K", "Q6_K", "Q8_0", "F32"}
