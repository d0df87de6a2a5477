"""What serving requests on different LoRA adapters costs: 8 clients over 4 adapters (2 each)
decoded together by the engine (one batched step, a gathered low-rank product per row), against
the same 8 clients on the base model alone, and against mlx-lm's way: reload the model with
each adapter (``mlx_lm.load(adapter_path=...)``) and decode that adapter's clients as a batch
(its ``batch_generate``), one adapter after the other.

The model is the offline SmolLM2-135M-Instruct converted once to an MLX dir (its 4-bit
weights kept: the adapters stay float beside ``quantized_matmul``); the adapters are mlx-lm's
own LoRA layers (rank 8 on q/k/v/o and the MLP of every layer, random B), saved in its layout.
Every client generates exactly ``--tokens`` tokens (EOS banned). Reported: aggregate generated
tokens/s (prefill included) for each way, and the ratios; and, less sensitive to a busy
machine, one 8-row decode step on 4 adapters over the same step on the base model.

Usage: python benchmarks/lora_mixed.py [--tokens 64] [--rounds 2] [--work .bench/lora_mixed]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from engine_throughput import PROMPTS  # the same 8 prompts (this script's dir is on the path)

ADAPTERS = 4
KEYS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def prepare(work: Path) -> tuple[Path, list[Path]]:
    """The MLX model dir and the adapter dirs (written once)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from adapter_support import write_mlx_lm_adapter
    from mlxformer.tools.converter import convert
    from mlxformer.default_model import default_model_path

    model = work / "smollm2"
    work.mkdir(parents=True, exist_ok=True)
    if not model.exists():
        convert(default_model_path(), model, progress=False)
    adapters = [work / f"adapter{i}" for i in range(ADAPTERS)]
    for i, path in enumerate(adapters):
        if not path.exists():
            write_mlx_lm_adapter(model, path, seed=i, rank=8, scale=2.0, keys=KEYS)
    return model, adapters


def engine_run(model_dir: Path, adapters: list[Path], tokens: int, mixed: bool) -> float:
    """Aggregate tokens/s of the 8 clients through the engine: on 4 adapters (``mixed``), or on
    the base model without any adapter loaded."""
    from mlxformer import load
    from mlxformer.adapters import attach_adapters, read_adapter
    from mlxformer.engine import Engine, GenerationRequest
    from mlxformer.sampling.options import SamplingSettings

    model, tokenizer = load(model_dir)
    bank = attach_adapters(model, [read_adapter(p) for p in adapters], [p.name for p in adapters]) if mixed else None
    sampling = SamplingSettings(logit_bias={t: -100.0 for t in tokenizer.eos_token_ids})
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    engine = Engine(model, tokenizer, max_batch=8, prefix_cache_bytes=0)
    engine.start()
    try:
        start = time.perf_counter()
        handles = [engine.submit(GenerationRequest(
            p, max_tokens=tokens, sampling=sampling,
            adapters=tuple(bank.vector([(i % ADAPTERS, 1.0)])) if bank is not None else None))
            for i, p in enumerate(prompts)]
        generated = sum(sum(e.token is not None for e in h) for h in handles)
        return generated / (time.perf_counter() - start)
    finally:
        engine.stop()


def step_overhead(model_dir: Path, adapters: list[Path], repeats: int = 30) -> float:
    """Median time of one decode forward of 8 rows on 4 adapters over the same forward on the
    base model (no row on an adapter), interleaved: the cost of the gathered low-rank products
    alone, less sensitive to a busy machine than whole runs."""
    import mlx.core as mx
    from mlxformer import load
    from mlxformer.adapters import attach_adapters, read_adapter
    from mlxformer.adapters.layers import select
    from mlxformer.cache import make_cache

    model, _ = load(model_dir)
    bank = attach_adapters(model, [read_adapter(p) for p in adapters], [p.name for p in adapters])

    class Row:
        def __init__(self, weights):
            self.adapters = weights

    rows = [Row(tuple(bank.vector([(i % ADAPTERS, 1.0)]))) for i in range(len(PROMPTS))]
    base = [Row(None) for _ in PROMPTS]
    tokens = mx.array([[100 + i] for i in range(len(PROMPTS))])  # (8, 1)
    times: dict[str, list[float]] = {"base": [], "mixed": []}
    for _ in range(repeats):
        for name, parts in (("base", base), ("mixed", rows)):
            cache = make_cache(model)
            start = time.perf_counter()
            with select(model, [(r, 1) for r in parts], rows=True):
                logits = model.last_logits(tokens, cache)
            mx.eval(logits)
            times[name].append(time.perf_counter() - start)
    return statistics.median(times["mixed"]) / statistics.median(times["base"])


def mlx_lm_reload(model_dir: Path, adapters: list[Path], tokens: int) -> float:
    """Aggregate tokens/s of mlx-lm reloading the model per adapter and batching its clients."""
    import mlx.core as mx
    from mlx_lm import batch_generate, load
    from mlx_lm.sample_utils import make_logits_processors

    start = time.perf_counter()
    generated = 0
    for i, adapter in enumerate(adapters):
        model, tokenizer = load(str(model_dir), adapter_path=str(adapter))
        prompts = [tokenizer.encode(p) for j, p in enumerate(PROMPTS) if j % ADAPTERS == i]
        bias = make_logits_processors(logit_bias={t: -100.0 for t in tokenizer.eos_token_ids})
        out = batch_generate(model, tokenizer, prompts, max_tokens=tokens, logits_processors=bias, return_token_ids=True)
        generated += sum(len(t) for t in out.token_ids)
        del model
        mx.clear_cache()
    return generated / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path(".bench/lora_mixed"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lora_mixed.json"))
    args = parser.parse_args()
    model_dir, adapters = prepare(args.work)
    runs: dict[str, list[float]] = {"base": [], "mixed": [], "mlx_lm_reload": []}
    for _ in range(args.rounds):  # interleaved, so a busy machine slows every way alike
        runs["base"].append(engine_run(model_dir, adapters, args.tokens, mixed=False))
        runs["mixed"].append(engine_run(model_dir, adapters, args.tokens, mixed=True))
        runs["mlx_lm_reload"].append(mlx_lm_reload(model_dir, adapters, args.tokens))
    median = {k: statistics.median(v) for k, v in runs.items()}
    step = step_overhead(model_dir, adapters)
    result = {"clients": len(PROMPTS), "adapters": ADAPTERS, "tokens": args.tokens, "tokens_per_s": median,
              "decode_step_mixed_over_base": step,
              "runs": runs, "mixed_over_base": median["mixed"] / median["base"],
              "mixed_over_mlx_lm_reload": median["mixed"] / median["mlx_lm_reload"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for name, value in median.items():
        print(f"{name:>14}: {value:7.1f} tok/s")
    print(f"mixed / base: {result['mixed_over_base']:.2f}   mixed / mlx-lm reload: {result['mixed_over_mlx_lm_reload']:.2f}"
          f"   one decode step, mixed / base: {step:.2f}")


if __name__ == "__main__":
    main()
