"""What converting a K-quant (or legacy-quant) GGUF with its exact scales (default) or with
``--dtype float16`` costs in mlx-lm: the dtype mlx-lm computes in, and its log-probs against
mlxformer's float32 load of the GGUF itself, with mlx-lm computing as loaded and in float32
(which isolates the rounding of the scales from that of the activations).

    python benchmarks/kquant_scales.py

A tiny random Llama (hidden 256, 2 layers; its logits are sensitive, see tests/conftest.py's
``perturb_``) written as GGUF by gguf-py with every matrix of one type.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

TOKENS = mx.array([[3, 17, 200, 41, 9, 77, 128, 5, 250, 31, 64, 2, 99, 180, 7, 13] * 3])
SHAPE = dict(hidden_size=256, intermediate_size=512, head_dim=64, num_attention_heads=4, num_key_value_heads=2)


def log_softmax(x: mx.array) -> np.ndarray:
    x = np.array(x.astype(mx.float32)).astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def main() -> None:
    from conftest import write_tiny_checkpoint
    from gguf import GGMLQuantizationType as T
    from gguf_helpers import write_gguf_from_hf
    from mlx_lm.utils import load_model

    from mlxformer import convert, load

    mx.set_default_device(mx.cpu)
    with tempfile.TemporaryDirectory() as tmp:
        _, hf_model = write_tiny_checkpoint(Path(tmp) / "hf", "llama", **SHAPE)
        for qtype in (T.Q4_K, T.Q5_K, T.Q5_0):
            path = Path(tmp) / f"{qtype.name}.gguf"
            write_gguf_from_hf(path, hf_model, "llama", lambda name, shape: qtype)
            ours, _ = load(path, dtype=mx.float32)
            reference = log_softmax(ours(TOKENS))
            for dtype in (None, "float16"):
                out = convert(path, Path(tmp) / f"{qtype.name}-{dtype}", dtype=dtype, progress=False)
                theirs, _ = load_model(out)
                as_loaded = theirs(TOKENS)
                theirs.set_dtype(mx.float32)
                in_float32 = theirs(TOKENS)
                print(f"{qtype.name} --dtype {dtype or '(default)'}: mlx-lm computes in "
                      f"{str(as_loaded.dtype).rpartition('.')[2]}; max |log-prob difference| as loaded "
                      f"{np.abs(log_softmax(as_loaded) - reference).max():.4f}, in float32 "
                      f"{np.abs(log_softmax(in_float32) - reference).max():.4f}")


if __name__ == "__main__":
    main()
