"""Run by ``test_rss_budget.py`` in a process of its own (its peak RSS is the process's): two
requests of ~1,000 prompt tokens under a KV budget sized for two (their KV plus one block each)
on the engine, set up as ``mlxformer serve`` sets it up (glibc's heap bounded first). Prints one
JSON line: the budget and step reserve, the peak RSS growth over the warmed-up baseline
(``VmHWM`` after ``clear_refs``), MLX's peak over its active bytes then, how many rows decoded
together, the preemptions, and whether each reply equals ``generate``'s alone.

    python tests/rss_budget_run.py MODEL_DIR PROMPT_TOKENS MAX_TOKENS
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import mlx.core as mx

from mlxformer import generate, load
from mlxformer.engine import Engine, GenerationRequest
from mlxformer.engine.memory import BLOCK
from mlxformer.server.heap import bound_heap_growth

CHUNK = 128


def vm(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` of this process, in bytes."""
    return int(re.search(field + r":\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def main() -> None:
    directory, prompt_tokens, max_tokens = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    bound_heap_growth()  # serve's first step
    model, tokenizer = load(directory, dtype=mx.float32)
    tokenizer.eos_token_ids = []
    prompts = [[(7 * j + 13 * i) % 250 + 1 for j in range(prompt_tokens + 8 * i)] for i in range(2)]
    expected = [generate(model, tokenizer, p, max_tokens, prefill_step_size=CHUNK) for p in prompts]
    sizer = Engine(model, tokenizer).sizer
    budget = sum(sizer.bytes_for(len(p) + max_tokens) + sizer.bytes_for(BLOCK) for p in prompts)
    engine = Engine(model, tokenizer, prefill_chunk=CHUNK, max_kv_memory=budget)
    decoding: list[int] = []
    real_run = engine._run

    def run(step) -> None:
        decoding.append(len(step.decode))
        real_run(step)

    engine._run = run
    with engine:
        list(engine.submit(GenerationRequest(prompts[0][:300], 2)))  # warm-up: kernels, first-use buffers
        engine.prefix_cache.evict_to(0)
        mx.clear_cache()
        decoding.clear()
        baseline, active = vm("VmRSS"), mx.get_active_memory()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts over from the RSS now
        mx.reset_peak_memory()
        handles = [engine.submit(GenerationRequest(p, max_tokens)) for p in prompts]
        replies = ["".join(e.text for e in h) for h in handles]
        peak = vm("VmHWM")
    print(json.dumps({
        "budget": budget, "reserve": engine.budget.reserve, "rss_growth": peak - baseline,
        "mlx_peak_growth": mx.get_peak_memory() - active, "together": max(decoding),
        "preemptions": engine.metrics.registry.get_sample_value("mlxformer_preemptions_total"),
        "equal_alone": [r == e for r, e in zip(replies, expected)],
    }))


if __name__ == "__main__":
    main()
