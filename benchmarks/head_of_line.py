"""Head-of-line: the time to first token of a short request sent while a long prompt prefills,
as a fraction of the long prompt's (issue 32: <= 0.1; 1.0 when the scheduler finished a prompt
before starting the next). In process, on the engine, with the default model unless --model.

    python benchmarks/head_of_line.py [--model PATH] [--long 3000] [--step-tokens N]
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time

from mlxformer import load
from mlxformer.default_model import default_model_path
from mlxformer.engine import Engine, GenerationRequest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--long", type=int, default=3000, help="long prompt tokens")
    parser.add_argument("--delay", type=float, default=0.05, help="seconds between the two requests")
    parser.add_argument("--step-tokens", type=int, default=None)
    args = parser.parse_args()
    model, tokenizer = load(args.model or default_model_path())
    rng = random.Random(0)
    vocab = model.args.vocab_size
    long = GenerationRequest([rng.randrange(100, vocab) for _ in range(args.long)], max_tokens=2)
    short = GenerationRequest(tokenizer.encode("Hi there"), max_tokens=2)
    first: dict[str, float] = {}

    def ttft(name: str, handle, sent: float) -> None:
        next(iter(handle))
        first[name] = time.perf_counter() - sent
        for _ in handle:
            pass

    with Engine(model, tokenizer, step_tokens=args.step_tokens, prefix_cache_bytes=0) as engine:
        alone_sent = time.perf_counter()
        ttft("short_alone", engine.submit(short), alone_sent)
        threads = []
        for name, request in (("long", long), ("short", short)):
            sent = time.perf_counter()
            thread = threading.Thread(target=ttft, args=(name, engine.submit(request), sent))
            thread.start()
            threads.append(thread)
            time.sleep(args.delay)
        for thread in threads:
            thread.join()
        step_tokens = engine.scheduler.step_tokens
    print(json.dumps({"long_tokens": args.long, "step_tokens": step_tokens, **{k: round(v, 3) for k, v in first.items()},
                      "short_over_long": round(first["short"] / first["long"], 3)}))


if __name__ == "__main__":
    main()
