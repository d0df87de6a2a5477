"""KV held once (issue 32): with ``max_kv_memory`` sized for two requests' KV plus one 256-token
block each, do two such requests run at once? Prints the budget, what the planner counts for
one request (``peak``) and for the second joining, how many decoded together, preemptions, the
wall time and the process's peak RSS growth over a warmed-up baseline (sampled every 5 ms).
In process, on the engine (what ``serve --max-kv-memory`` runs), greedy.

    python benchmarks/kv_two_requests.py [--model PATH] [--tokens 1400] [--max-tokens 40]
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time

import mlx.core as mx
import psutil

from mlxformer import load
from mlxformer.default_model import default_model_path
from mlxformer.engine import Engine, GenerationRequest
from mlxformer.engine.memory import BLOCK


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=1400, help="prompt + max_tokens of each request")
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args()
    model, tokenizer = load(args.model or default_model_path())
    rng = random.Random(0)
    vocab = model.args.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.tokens - args.max_tokens)] for _ in range(2)]
    sizer = Engine(model, tokenizer).sizer
    own = sizer.bytes_for(args.tokens)
    budget = 2 * (own + sizer.bytes_for(BLOCK))
    engine = Engine(model, tokenizer, max_kv_memory=budget)
    decoding: list[int] = []
    real_run = engine._run

    def run(step):
        decoding.append(len(step.decode))
        real_run(step)

    engine._run = run
    with engine:  # warm-up: kernels and buffers of a short request
        list(engine.submit(GenerationRequest(prompts[0][:300], 2)))
    engine.prefix_cache.evict_to(0)
    decoding.clear()
    process, peak, done = psutil.Process(), [0], threading.Event()
    baseline = process.memory_info().rss

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], process.memory_info().rss)

    sampler = threading.Thread(target=sample)
    sampler.start()
    start = time.perf_counter()
    with engine:
        handles = [engine.submit(GenerationRequest(p, args.max_tokens)) for p in prompts]
        replies = [[e.token for e in h] for h in handles]
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    mib = 2**20
    print(json.dumps({
        "tokens_each": args.tokens, "own_kv_mib": round(own / mib, 2), "budget_mib": round(budget / mib, 2),
        "planner_peak_one_mib": round(sizer.peak(args.tokens) / mib, 2),
        "max_decoding_together": max(decoding), "completed": [len(r) for r in replies],
        "preemptions": engine.metrics.registry.get_sample_value("mlxformer_preemptions_total"),
        "wall_s": round(wall, 1), "peak_rss_growth_mib": round(max(peak[0] - baseline, 0) / mib, 1),
        "mlx_cache_mib": round(mx.get_cache_memory() / mib, 1),
    }))


if __name__ == "__main__":
    main()
