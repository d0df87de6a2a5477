"""What converting a K-quant GGUF with float32 (default) or float16 (``--dtype float16``)
scales costs in mlx-lm: the logits' distance from the GGUF's own, and the dtype mlx-lm then
computes (and caches keys/values) in.

    python benchmarks/kquant_scales.py

The SmolLM2 Q4_K_M file is made from the shipped Q4_1 GGUF (dequantized by gguf-py, then
quantized with llama.cpp's per-tensor Q4_K_M choices by ``tests/gguf_helpers.py``).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

TEXT = "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after"


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def main() -> None:
    from gguf_helpers import FloatSource, requantize_gguf
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from mlxformer import convert, load
    from mlxformer.default_model import default_model_path

    mx.set_default_device(mx.cpu)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "smollm-Q4_K_M.gguf"
        requantize_gguf(FloatSource(default_model_path()), path, "Q4_K_M")
        model, tokenizer = load(path, dtype=mx.float32)
        ids = mx.array([tokenizer.encode(TEXT)])
        reference = np.array(model(ids)[0])
        for dtype in (None, "float16"):
            out = convert(path, Path(tmp) / f"out-{dtype}", dtype=dtype, progress=False)
            theirs, _ = load_model(out)
            cache = make_prompt_cache(theirs)
            logits = theirs(ids, cache=cache)[0]
            err = np.abs(log_softmax(np.array(logits.astype(mx.float32))) - log_softmax(reference))
            agree = float((np.array(logits.astype(mx.float32)).argmax(-1) == reference.argmax(-1)).mean())
            keys = cache[0].state[0]
            print(f"convert --dtype {dtype or '(default)'}: mlx-lm computes in {logits.dtype}, KV cache {keys.dtype}; "
                  f"max |log-prob difference| vs the GGUF {err.max():.4f} (mean {err.mean():.5f}), "
                  f"argmax agreement {agree:.3f}")


if __name__ == "__main__":
    main()
