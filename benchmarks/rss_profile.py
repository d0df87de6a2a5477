"""Where the memory above weights + KV goes (issue 32): two requests under a ``max_kv_memory``
sized for two (their KV plus one block each) run on the engine, in process; after every engine
step one line: the KV bytes held (caches + prefix cache), MLX's active / peak-of-the-step / cache
bytes, and the process's RSS and its peak over the step (``VmRSS`` / ``VmHWM``, reset per step
through ``/proc/self/clear_refs``), all as growth over the warmed-up baseline, in MiB.

    python benchmarks/rss_profile.py [--model PATH] [--tokens 1000] [--max-tokens 20] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import time
from pathlib import Path

import mlx.core as mx

from mlxformer import load
from mlxformer.default_model import default_model_path
from mlxformer.engine import Engine, GenerationRequest
from mlxformer.engine.memory import BLOCK
from mlxformer.server.heap import bound_heap_growth

MIB = 2**20


def vm(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` of this process, in bytes (Linux)."""
    return int(re.search(field + r":\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def reset_hwm() -> None:
    """Start ``VmHWM`` over from the RSS now."""
    Path("/proc/self/clear_refs").write_text("5")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=1000, help="prompt tokens of each request")
    parser.add_argument("--max-tokens", type=int, default=20)
    parser.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: the engine's)")
    parser.add_argument("--cache-limit", type=float, default=None, help="MLX's cache limit, MiB (default: the engine's)")
    parser.add_argument("--json", type=Path, default=None, help="write the per-step rows here")
    parser.add_argument("--glibc-defaults", action="store_true", help="not glibc's fixed mmap threshold (serve sets it)")
    args = parser.parse_args()
    if not args.glibc_defaults:
        bound_heap_growth()  # what `mlxformer serve` does first
    model, tokenizer = load(args.model or default_model_path(), dtype=args.dtype)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, model.args.vocab_size) for _ in range(args.tokens)] for _ in range(2)]
    sizer = Engine(model, tokenizer).sizer
    own = sizer.bytes_for(args.tokens + args.max_tokens)
    budget = 2 * (own + sizer.bytes_for(BLOCK))
    engine = Engine(model, tokenizer, max_kv_memory=budget, prefill_chunk=args.chunk)
    rows: list[dict] = []
    real_run = engine._run

    def run(step) -> None:
        mx.reset_peak_memory()
        reset_hwm()
        start = time.perf_counter()
        real_run(step)
        mx.synchronize()
        rows.append({
            "decode": len(step.decode), "chunks": [len(c.tokens) for c in step.prefill],
            "s": round(time.perf_counter() - start, 2),
            "kv": round(engine.kv_bytes() / MIB, 1), "prefix": round(engine.prefix_cache.nbytes / MIB, 1),
            "active": round((mx.get_active_memory() - base_active) / MIB, 1),
            "peak": round((mx.get_peak_memory() - base_active) / MIB, 1),
            "cache": round(mx.get_cache_memory() / MIB, 1),
            "rss": round((vm("VmRSS") - base_rss) / MIB, 1), "hwm": round((vm("VmHWM") - base_rss) / MIB, 1),
        })
        print(json.dumps(rows[-1]), flush=True)

    with engine:  # warm-up: kernels and first-use buffers of a short request
        list(engine.submit(GenerationRequest(prompts[0][:300], 2)))
    engine.prefix_cache.evict_to(0)
    mx.clear_cache()
    base_active, base_rss = mx.get_active_memory(), vm("VmRSS")
    engine._run = run
    reset_hwm()
    with engine:
        if args.cache_limit is not None:
            mx.set_cache_limit(int(args.cache_limit * MIB))
        handles = [engine.submit(GenerationRequest(p, args.max_tokens)) for p in prompts]
        replies = [[e.token for e in h] for h in handles]
    peak = max(r["hwm"] for r in rows)
    summary = {
        "model": str(args.model or default_model_path()), "dtype": args.dtype, "tokens": args.tokens,
        "max_tokens": args.max_tokens, "weights_mib": round(base_active / MIB, 1), "budget_mib": round(budget / MIB, 2),
        "completed": [len(r) for r in replies], "max_decoding_together": max(r["decode"] for r in rows),
        "peak_rss_growth_mib": peak, "growth_over_budget": round(peak * MIB / budget, 3),
        "peak_mlx_over_weights_mib": max(r["peak"] for r in rows), "reserve_mib": round(engine.budget.reserve / MIB, 1),
        "load": os.getloadavg()[0],
    }
    print(json.dumps(summary))
    if args.json is not None:
        args.json.write_text(json.dumps({"summary": summary, "steps": rows}, indent=1))


if __name__ == "__main__":
    main()
