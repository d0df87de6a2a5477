"""Perplexity through float / 8-bit / 4-bit KV caches, with mlx-lm's 4-bit cache on the same weights.

The README's "Quantized KV cache quality" table: the default SmolLM2-135M-Instruct (CPU policy:
float32 activations), the first ``--tokens`` scored tokens of tests/data/eval.txt fed in 64-token
chunks through each cache, group size 64. Past eval.txt's ~500 tokens the text goes on with
Python's own reference manual (``pydoc_data.topics``, in the standard library: offline, fixed
per Python version), enough for 8,192 tokens.

    python benchmarks/kv_quality.py [--tokens 256] [--chunk 64] [--skip-8bit] [--rows float,8,4,mlx-lm]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pydoc_data.topics

from mlxformer.cache import CacheSettings, make_cache
from mlxformer.default_model import default_model_path
from mlxformer.loader import load
from mlxformer.tools.perplexity import cached_perplexity as chunked_perplexity

EVAL_TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "eval.txt"
GROUP_SIZE = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens scored")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--skip-8bit", action="store_true", help="only float, 4-bit and mlx-lm's 4-bit")
    parser.add_argument("--rows", default="float,8,4,mlx-lm",
                        help="rows to score, of float,8,4,mlx-lm (long runs: one process per row)")
    args = parser.parse_args()

    from kv_cache import mlx_lm_twin  # benchmarks/ sibling: mlx-lm Llama with the same weights
    from mlx_lm.models.cache import QuantizedKVCache

    model, tokenizer = load(default_model_path())
    ids = tokenizer.encode(EVAL_TEXT.read_text())[: args.tokens + 1]
    if len(ids) <= args.tokens:  # long contexts: the text goes on with Python's reference manual
        topics = pydoc_data.topics.topics
        more = "\n\n".join(topics[k] for k in sorted(topics))[: 8 * args.tokens]
        ids = tokenizer.encode(EVAL_TEXT.read_text() + "\n\n" + more)[: args.tokens + 1]
    ours = lambda x, c: model(x, c)  # noqa: E731
    rows: dict[str, float] = {}

    def score(name: str, forward, cache) -> None:
        rows[name] = chunked_perplexity(forward, cache, ids, args.chunk)
        print(f"{name}: {rows[name]:.4f}", flush=True)  # long runs: each row as soon as it is known

    wanted = set(args.rows.split(",")) - ({"8"} if args.skip_8bit else set())
    if "float" in wanted:
        score("float", ours, make_cache(model))
    for bits in (b for b in (8, 4) if str(b) in wanted):
        settings = CacheSettings(kv_bits=bits, kv_group_size=GROUP_SIZE)
        score(f"{bits}-bit, group 64", ours, make_cache(model, settings))
    if "mlx-lm" in wanted:
        twin = mlx_lm_twin(model)
        peer_cache = [QuantizedKVCache(group_size=GROUP_SIZE, bits=4) for _ in twin.layers]
        score("mlx-lm 4-bit, group 64 (same weights)", lambda x, c: twin(x, cache=c), peer_cache)
    if "float" not in rows:
        return
    base = rows["float"]
    print(f"\nSmolLM2-135M, {len(ids) - 1} tokens of eval.txt (+ pydoc_data.topics) in {args.chunk}-token chunks")
    print("| cache | perplexity | Δ vs float |\n|---|---:|---:|")
    for name, ppl in rows.items():
        delta = "—" if name == "float" else f"{100 * (ppl / base - 1):+.2f}%"
        print(f"| {name} | {ppl:.4f} | {delta} |")


if __name__ == "__main__":
    main()
