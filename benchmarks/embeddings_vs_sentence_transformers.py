"""Embeddings per second: mlxformer beside sentence-transformers (torch, CPU) on the same
checkpoint, batch 32, trials interleaved A B / B A in one run.

The checkpoint is Qwen3-Embedding-0.6B-shaped (hidden 1024, 16 query and 8 K/V heads of 128,
MLP 3072, last-token pooling, L2 norm) with fewer layers (``--layers``, default 2) and a byte
vocabulary (the vocabulary only changes the embedding lookup), random weights, saved by
sentence-transformers. Both runtimes embed the same texts (~``--chars`` characters each, one token
a character) in batches of 32, float32; the closing line gives the median rate of each and the
mlxformer/sentence-transformers ratio (higher: mlxformer faster), and the largest difference
between their vectors.

Usage: python benchmarks/embeddings_vs_sentence_transformers.py [--layers 2] [--texts 64] [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

BATCH = 32
SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
             vocab_size=260, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True)


def write_model(root: Path, layers: int) -> Path:
    """A Qwen3-Embedding-shaped sentence-transformers dir (random weights) under ``root``."""
    import torch
    from sentence_transformers import SentenceTransformer, models
    from tokenizers import Tokenizer, processors
    from tokenizers import models as token_models
    from transformers import AutoConfig, AutoModel

    base = root / "base"
    base.mkdir()
    torch.manual_seed(0)
    AutoModel.from_config(AutoConfig.for_model("qwen3", num_hidden_layers=layers, **SHAPE)).save_pretrained(base)
    tokenizer = Tokenizer(token_models.BPE(vocab={chr(i): i for i in range(256)}, merges=[]))
    tokenizer.post_processor = processors.TemplateProcessing(single="$A \x01", special_tokens=[("\x01", 1)])
    tokenizer.save(str(base / "tokenizer.json"))
    (base / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "\x00", "eos_token": "\x01"}))
    model = SentenceTransformer(modules=[models.Transformer(str(base)), models.Pooling(1024, "lasttoken"),
                                         models.Normalize()], device="cpu")
    model.save(str(root / "model"))
    return root / "model"


def texts_of(count: int, chars: int) -> list[str]:
    rng = random.Random(0)
    words = ["model", "vector", "search", "query", "document", "the", "a", "of", "relevant", "passage", "answer"]
    out = []
    for _ in range(count):
        text = ""
        while len(text) < chars * rng.uniform(0.6, 1.0):
            text += rng.choice(words) + " "
        out.append(text.strip())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--chars", type=int, default=96)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()

    import mlx.core as mx
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    from mlxformer import load
    from mlxformer.embeddings.encode import embed

    texts = texts_of(args.texts, args.chars)
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_model(Path(tmp), args.layers)
        reference = SentenceTransformer(str(directory), device="cpu")
        model, tokenizer = load(directory, dtype=mx.float32)

        def run_st() -> np.ndarray:
            with torch.inference_mode():
                return reference.encode(texts, batch_size=BATCH, normalize_embeddings=True)

        def run_ours() -> np.ndarray:
            return np.concatenate([embed(model, tokenizer, texts[i:i + BATCH]) for i in range(0, len(texts), BATCH)])

        runs = {"mlxformer": run_ours, "sentence-transformers": run_st}
        outputs = {name: run() for name, run in runs.items()}  # warm-up (and the vectors compared)
        rates: dict[str, list[float]] = {name: [] for name in runs}
        for trial in range(args.trials):
            for name in (list(runs) if trial % 2 == 0 else list(runs)[::-1]):
                start = time.perf_counter()
                runs[name]()
                rates[name].append(len(texts) / (time.perf_counter() - start))
    diff = float(np.abs(outputs["mlxformer"] - outputs["sentence-transformers"]).max())
    medians = {name: statistics.median(r) for name, r in rates.items()}
    for name, r in rates.items():
        print(f"{name}: {', '.join(f'{x:.1f}' for x in r)} embeddings/s (median {medians[name]:.1f})")
    ratio = medians["mlxformer"] / medians["sentence-transformers"]
    print(f"{args.layers} layers, {len(texts)} texts of ~{args.chars} tokens, batch {BATCH}, torch threads "
          f"{torch.get_num_threads()}: mlxformer/sentence-transformers = {ratio:.2f}x; max |diff| {diff:.1e}",
          file=sys.stdout)


if __name__ == "__main__":
    main()
