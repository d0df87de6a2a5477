"""GGUF tensor types: load time, decode speed and memory at rest against the file size.

mlx-lm cannot load GGUF files (it only exports F16 ones), so each type is compared with our own
F16 and Q8_0 loads of the same model. Two sets of files, written once into .bench/gguf_types:

- ``pure``: a random Llama of SmolLM-like size but with 256-multiple widths (hidden 768,
  intermediate 2048, 12 layers, vocab 32000), every matrix of one type, so each K type is
  measured on its own (SmolLM2's 576-wide rows cannot hold K-quants);
- ``smollm``: SmolLM2-135M as llama.cpp's Q4_K_M/Q5_K_M/Q6_K/Q8_0/Q4_0 mixes from one float
  source, with the max |logit difference| against transformers on the same file.

Each trial runs in its own subprocess (memory at rest = MLX active memory after load); the
types are interleaved trial by trial. Usage:
  python benchmarks/gguf_types.py [--trials 3] [--sets pure smollm]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / ".bench" / "gguf_types"
PURE_TYPES = ["F16", "Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0", "Q3_K", "Q2_K"]
SMOLLM_MIXES = ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0"]
PURE_SHAPE = dict(vocab=32000, hidden=768, intermediate=2048, layers=12, heads=12, kv_heads=4)
PROMPT_TOKENS, DECODE_TOKENS = 16, 32


def _helpers():
    sys.path.insert(0, str(ROOT / "tests"))
    import gguf_helpers

    return gguf_helpers


def write_pure(qtype: str, path: Path) -> None:
    """A random Llama with every matrix of ``qtype`` (norms F32), written with gguf-py."""
    import gguf
    import numpy as np

    h = _helpers()
    s = PURE_SHAPE
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(2048)
    writer.add_embedding_length(s["hidden"])
    writer.add_block_count(s["layers"])
    writer.add_feed_forward_length(s["intermediate"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(s["vocab"])
    head_dim = s["hidden"] // s["heads"]
    shapes = {"token_embd.weight": (s["vocab"], s["hidden"]), "output.weight": (s["vocab"], s["hidden"]),
              "output_norm.weight": (s["hidden"],)}
    for i in range(s["layers"]):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (s["hidden"],), f"blk.{i}.ffn_norm.weight": (s["hidden"],),
            f"blk.{i}.attn_q.weight": (s["hidden"], s["hidden"]),
            f"blk.{i}.attn_k.weight": (s["kv_heads"] * head_dim, s["hidden"]),
            f"blk.{i}.attn_v.weight": (s["kv_heads"] * head_dim, s["hidden"]),
            f"blk.{i}.attn_output.weight": (s["hidden"], s["hidden"]),
            f"blk.{i}.ffn_gate.weight": (s["intermediate"], s["hidden"]),
            f"blk.{i}.ffn_up.weight": (s["intermediate"], s["hidden"]),
            f"blk.{i}.ffn_down.weight": (s["hidden"], s["intermediate"]),
        })
    for name, shape in shapes.items():
        if len(shape) == 1:
            h.add_tensor(writer, name, np.ones(shape, np.float32), gguf.GGMLQuantizationType.F32)
        else:
            x = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[1])).astype(np.float32)
            h.add_tensor(writer, name, x, gguf.GGMLQuantizationType[qtype])
    h._finish(writer)


def prepare(sets: list[str]) -> dict[str, Path]:
    OUT.mkdir(parents=True, exist_ok=True)
    files = {}
    if "pure" in sets:
        for qtype in PURE_TYPES:
            path = OUT / f"pure-{qtype}.gguf"
            if not path.exists():
                write_pure(qtype, path)
            files[f"pure {qtype}"] = path
    if "smollm" in sets:
        from mlxformer.default_model import default_model_path

        source = None
        for mix in SMOLLM_MIXES:
            path = OUT / f"smollm-{mix}.gguf"
            if not path.exists():
                source = source or _helpers().FloatSource(default_model_path())
                _helpers().requantize_gguf(source, path, mix, tokenizer=False)
            files[f"smollm {mix}"] = path
    return files


def worker(path: str) -> None:
    """One trial in this process: load, memory at rest, greedy decode; prints JSON."""
    import mlx.core as mx

    from mlxformer.tools.bench import measure, mlxformer_loop, random_prompt
    from mlxformer.loader import apply_dtype_policy, build_model, read_checkpoint
    from mlxformer.models.row_sharding import apply_thread_policy

    start = time.perf_counter()
    config, weights, _ = read_checkpoint(Path(path))
    model = build_model(config, weights)
    apply_dtype_policy(model, None)
    apply_thread_policy(model, None)
    mx.eval(model.parameters())
    load_s = time.perf_counter() - start
    del weights
    mx.clear_cache()
    rest = mx.get_active_memory()
    trial = measure(mlxformer_loop(model), random_prompt(model.args.vocab_size, PROMPT_TOKENS), DECODE_TOKENS)
    print(json.dumps({"load_s": load_s, "rest_bytes": rest, "decode_tps": trial.decode_tps}))


def logits_error(path: Path) -> float:
    """Max |logit difference| against transformers loading the same file (float32)."""
    import mlx.core as mx
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from mlxformer.loader import apply_dtype_policy, build_model, read_checkpoint

    ids = [[1, 504, 3575, 282, 4649, 314, 2233, 30, 378, 1062, 13, 10850, 28, 5646, 29, 39]]
    config, weights, _ = read_checkpoint(path)
    model = build_model(config, weights)
    apply_dtype_policy(model, None)
    ours = np.array(model(mx.array(ids)).astype(mx.float32))
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits.numpy()
    return float(np.abs(ours - theirs).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--sets", nargs="+", default=["pure", "smollm"], choices=["pure", "smollm"])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    files = prepare(args.sets)
    runs: dict[str, list[dict]] = {name: [] for name in files}
    for trial in range(args.trials):
        names = list(files) if trial % 2 == 0 else list(reversed(files))
        for name in names:
            proc = subprocess.run([sys.executable, __file__, "--worker", str(files[name])],
                                  capture_output=True, text=True, check=True)
            runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"{'file':<16} {'file MB':>8} {'rest MB':>8} {'rest/file':>9} {'load s':>7} {'decode t/s':>10} "
          f"{'vs F16/Q8_0':>11} {'max dlogit':>10}")
    baseline = {}
    for name, results in runs.items():
        med = {k: statistics.median(r[k] for r in results) for k in results[0]}
        group = name.split()[0]
        baseline.setdefault(group, med["decode_tps"])  # first of each set: F16 (pure) / Q8_0 (smollm)
        size = files[name].stat().st_size
        err = f"{logits_error(files[name]):.4f}" if group == "smollm" else ""
        print(f"{name:<16} {size / 1e6:8.1f} {med['rest_bytes'] / 1e6:8.1f} {med['rest_bytes'] / size:9.2f} "
              f"{med['load_s']:7.2f} {med['decode_tps']:10.1f} {med['decode_tps'] / baseline[group]:11.2f} {err:>10}")


if __name__ == "__main__":
    main()
