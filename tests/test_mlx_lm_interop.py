"""MLX model dirs written by mlx-lm's ``convert`` (float and 4-bit) load in mlxformer and give
mlx-lm's own logits for them."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mlxformer import load

# Both runtimes run the same MLX kernels (fast RMSNorm/RoPE/SDPA, quantized_matmul) on identical
# float32 weights/scales; measured difference is exactly 0 today. 1e-4 allows for a harmless
# regrouping of ops (fp32 rounding over 30 layers) yet is far below the O(1) shifts of a wrong
# weight, rope base, group size or bit width.
LOGPROB_BOUND = 1e-4
TEXT = "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France."


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.fixture(scope="module", params=["float", "4bit"])
def mlx_dir(request, smollm_hf_dir, tmp_path_factory):
    from mlx_lm.convert import convert

    path = tmp_path_factory.mktemp("mlx_lm") / request.param
    if request.param == "float":
        convert(hf_path=str(smollm_hf_dir), mlx_path=str(path))
    else:
        convert(hf_path=str(smollm_hf_dir), mlx_path=str(path), quantize=True, q_bits=4, q_group_size=64)
    # mlx-lm 0.32 reads only a top-level ``rope_theta`` (default 10000) and ignores the
    # ``rope_parameters`` that transformers 5 writes; SmolLM2 uses 1e5. Spell it the classic way
    # too, as mlx-community dirs converted from transformers-4 configs do, so the reference is right.
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    assert config["rope_theta"] == 1e5
    config_path.write_text(json.dumps(config, indent=2))
    return request.param, path


def test_mlx_lm_dir_matches_mlx_lm(mlx_dir):
    import mlx_lm

    kind, path = mlx_dir
    config = json.loads((path / "config.json").read_text())
    assert ("quantization" in config) == (kind == "4bit")

    ref_model, ref_tokenizer = mlx_lm.load(str(path))
    model, tokenizer = load(path)
    ref_model.set_dtype(mx.float32)  # float32 weights, and float32 scales/biases when quantized
    model.set_dtype(mx.float32)
    if kind == "4bit":
        layer = model.model.layers[0].self_attn.q_proj
        assert layer.bits == 4 and layer.group_size == 64 and layer.scales.dtype == mx.float32

    ids = ref_tokenizer.encode(TEXT)
    assert tokenizer.encode(TEXT) == ids
    ref = np.array(ref_model(mx.array([ids]))[0])
    got = np.array(model(mx.array([ids]))[0])
    assert got.shape == ref.shape == (len(ids), 49152)
    assert float(np.abs(log_softmax(got) - log_softmax(ref)).max()) <= LOGPROB_BOUND
    assert (got.argmax(-1) == ref.argmax(-1)).all()
