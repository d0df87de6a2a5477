"""Measure every quantization recipe on SmolLM2-135M-Instruct and print a Markdown table.

    python scripts/measure_recipes.py [--work DIR] [--text tests/data/eval.txt]

Float source: the default Q4_1 GGUF dequantized by transformers and saved in float32
(``save_pretrained``). Each recipe is converted with ``mlxformer.convert``; mlx-lm's default
``-q`` with ``mlx_lm.convert``. Perplexity uses ``mlxformer.tools.perplexity.perplexity`` (context
256, stride 128) with float32 activations. The forward pass is transformers' Llama (float32)
loaded with each MLX dir's weights dequantized by ``mx.dequantize`` — the same math as
``quantized_matmul`` with float32 scales/activations, and ~30x faster than MLX's CPU matmul
on this machine (whose mlx-cpu wheel uses reference BLAS).

Bits per weight: (bits * n + 32 * n / group_size) / n summed over every matrix (all
projections and the embedding, tied as lm_head), i.e. a 16-bit scale and bias per group;
matrices left float count 16 bits. Norm vectors are excluded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def build_float_source(out: Path) -> Path:
    """The default GGUF dequantized to float32 by transformers, in HF layout (cached in ``out``)."""
    if (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mlxformer.default_model import default_model_path

    gguf = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None  # the weights are plain float now; GGUF "quantization" is only the source format
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def dequantized_state(mlx_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of an MLX dir as float32 numpy, quantized triplets dequantized."""
    config = json.loads((mlx_dir / "config.json").read_text())
    quant = config.get("quantization") or {}
    weights: dict[str, mx.array] = {}
    for file in sorted(mlx_dir.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    out: dict[str, np.ndarray] = {}
    for key, value in weights.items():
        path, _, leaf = key.rpartition(".")
        if leaf in ("scales", "biases"):
            continue
        if leaf == "weight" and f"{path}.scales" in weights:
            spec = quant.get(path) if isinstance(quant.get(path), dict) else quant
            value = mx.dequantize(value, weights[f"{path}.scales"].astype(mx.float32),
                                  weights[f"{path}.biases"].astype(mx.float32),
                                  group_size=int(spec["group_size"]), bits=int(spec["bits"]))
        out[key] = np.array(value.astype(mx.float32))
    return out


class TorchLogits:
    """``model(tokens (1, T) mx) -> logits mx``: transformers' float32 forward with given weights."""

    def __init__(self, float_source: Path, state: dict[str, np.ndarray]):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(float_source)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        self.load(state)

    def load(self, state: dict[str, np.ndarray]) -> None:
        """Load an MLX dir's float32 state strictly (every key, no extra): a tied ``lm_head``
        gets the embedding, as transformers ties it."""
        torch = self.torch
        tensors = {k: torch.from_numpy(v) for k, v in state.items()}
        if self.model.config.tie_word_embeddings and "lm_head.weight" not in tensors:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
        self.model.load_state_dict(tensors, strict=True)
        self.model.tie_weights()

    def __call__(self, tokens: mx.array) -> mx.array:
        with self.torch.no_grad():
            logits = self.model(self.torch.tensor(np.array(tokens), dtype=self.torch.long)).logits
        return mx.array(logits.float().numpy())


def matrix_bits_per_weight(mlx_dir: Path, float_bits: int = 16) -> float:
    """Average stored bits per matrix weight of an MLX dir (see the module docstring)."""
    config = json.loads((mlx_dir / "config.json").read_text())
    quant = config.get("quantization") or {}
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(mlx_dir.glob("*.safetensors")):
        shapes.update({k: v.shape for k, v in mx.load(str(file)).items()})
    total = n_all = 0.0
    for key, shape in shapes.items():
        path, _, leaf = key.rpartition(".")
        if leaf != "weight" or len(shape) != 2:
            continue
        if f"{path}.scales" in shapes:
            spec = quant.get(path) if isinstance(quant.get(path), dict) else quant
            bits, group = int(spec["bits"]), int(spec["group_size"])
            n = shape[0] * shape[1] * 32 // bits
            total += n * (bits + 32 / group)
        else:
            n = shape[0] * shape[1]
            total += n * float_bits
        n_all += n
    return total / n_all


RECIPES: list[tuple[str, dict[str, Any]]] = [
    ("rtn 4-bit g64 (min/max)", {"quantize": True, "quant_recipe": "rtn"}),
    ("search 4-bit g64 (no calibration)", {"quantize": True, "quant_recipe": "search"}),
    ("uniform 4-bit g32", {"quantize": True, "quant_recipe": "uniform", "q_group_size": 32}),
    ("uniform 4-bit g64", {"quantize": True, "quant_recipe": "uniform", "q_group_size": 64}),
    ("uniform 4-bit g128", {"quantize": True, "quant_recipe": "uniform", "q_group_size": 128}),
    ("mixed 4-bit g64 (down_proj g32)", {"quantize": True, "quant_recipe": "mixed"}),
    ("mixed_embed 4-bit g64 (embed/v g32, down g128)", {"quantize": True, "quant_recipe": "mixed_embed"}),
    ("mixed_6 4-bit g64 (6-bit embed/v/down)", {"quantize": True, "quant_recipe": "mixed_6"}),
    ("uniform 8-bit g64", {"quantize": True, "quant_recipe": "uniform", "q_bits": 8}),
    ("default `-q`", {"quantize": True}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/mlxformer-recipes"))
    parser.add_argument("--text", type=Path, default=REPO / "tests/data/eval.txt")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--stride", type=int, default=128)
    args = parser.parse_args()

    import mlx_lm

    from mlxformer import convert
    from mlxformer.tools.perplexity import perplexity
    from mlxformer.text.tokenizer import load_tokenizer_from_dir

    args.work.mkdir(parents=True, exist_ok=True)
    source = build_float_source(args.work / "float-source")
    ids = load_tokenizer_from_dir(source).encode(args.text.read_text(encoding="utf-8"))

    def measure(mlx_dir: Path | None) -> float:
        state = dequantized_state(mlx_dir) if mlx_dir else _float_state(source)
        return perplexity(TorchLogits(source, state), ids, args.context, args.stride)

    base = measure(None)
    rows = [("float32 source", base, 32.0, 0.0)]
    for label, kwargs in RECIPES:
        out = args.work / label.split(" (")[0].replace(" ", "_").replace("`", "")
        start = time.perf_counter()
        convert(source, out, force=True, progress=False, **kwargs)
        seconds = time.perf_counter() - start
        rows.append((label, measure(out), matrix_bits_per_weight(out), seconds))
        print(f"{label}: done in {seconds:.1f} s", file=sys.stderr)
    out = args.work / "mlx_lm_default_q"
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    mlx_lm.convert(str(source), str(out), quantize=True)
    rows.append(("mlx-lm default `-q` (4-bit g64 min/max)", measure(out), matrix_bits_per_weight(out),
                 time.perf_counter() - start))

    print(f"\nSmolLM2-135M-Instruct, {len(ids)} tokens of {args.text.name}, context {args.context}, "
          f"stride {args.stride}, float32 activations\n")
    print("| recipe | bits/weight | perplexity | Δ vs float | convert time |")
    print("|---|---:|---:|---:|---:|")
    for label, ppl, bpw, seconds in rows:
        delta = "—" if label.startswith("float") else f"{100 * (ppl / base - 1):+.2f}%"
        print(f"| {label} | {bpw:.3f} | {ppl:.4f} | {delta} | {seconds:.1f} s |")


def _float_state(source: Path) -> dict[str, np.ndarray]:
    return {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(source / "model.safetensors")).items()}


if __name__ == "__main__":
    main()
