"""Speculative decoding in the batching engine: aggregate tokens/s of concurrent input-grounded
requests (each repeats its own ~100-token text, greedy) with and without prompt lookup, beside
mlx-lm's ``batch_generate`` (which has no speculation) on the same model files, interleaved
round by round.

The engine's greedy output is the same with and without speculation, so both generate the
same tokens; mlx-lm's batch may stop elsewhere (tokens/s normalizes). Reported: whole-run
generated tokens/s (prompt processing included, as a server sees it), the ratio to the plain
engine at the same concurrency, and prompt lookup's acceptance.

Usage: python benchmarks/engine_speculative.py [--model .bench/models/smollm2-f32] [--tokens 64]
       [--clients 1 4] [--rounds 1] [--num-draft-tokens 8] [--no-mlx-lm]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

TEXTS = [
    "The river town of Ashford woke slowly on market days. Before dawn the bakers lit their ovens, and by six "
    "the smell of bread drifted across the square where the farmers unloaded their carts of apples and cheese.",
    "At the far end of the square an old woman sold seeds from small paper envelopes, each one labelled in her "
    "neat handwriting: beans, marigolds, sweet peas, and a kind of tomato nobody else in the valley grew.",
    "The mayor, a careful man who wrote everything down, walked the rows with his notebook and counted the "
    "stalls. Forty-two this week, he wrote, two more than last, and he closed the notebook with a smile.",
    "When the church bell rang nine the square was full, and the noise of bargaining rose over the river, where "
    "the ferryman waited with his long pole for the first travellers coming over from the other bank.",
]


def engine_run(engine, prompts: list[list[int]], tokens: int) -> tuple[float, int, int]:
    """(aggregate generated tokens/s over the run, proposed, accepted)."""
    from mlxformer.engine import GenerationRequest

    finals: list = [None] * len(prompts)
    counts = [0] * len(prompts)
    start = time.perf_counter()
    handles = [engine.submit(GenerationRequest(p, max_tokens=tokens)) for p in prompts]

    def consume(i: int) -> None:
        for event in handles[i]:
            counts[i] += event.token is not None
            finals[i] = event

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    return sum(counts) / elapsed, sum(f.proposed_tokens for f in finals), sum(f.accepted_tokens for f in finals)


def mlx_lm_batch(model, tokenizer, prompts: list[list[int]], tokens: int) -> float:
    from mlx_lm.generate import batch_generate

    start = time.perf_counter()
    response = batch_generate(model, tokenizer, prompts, max_tokens=tokens, return_token_ids=True)
    elapsed = time.perf_counter() - start
    return sum(len(t) for t in response.token_ids) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path(".bench/models/smollm2-f32"))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--num-draft-tokens", type=int, default=8)
    parser.add_argument("--no-mlx-lm", action="store_true")
    args = parser.parse_args()

    from mlxformer import load
    from mlxformer.engine import Engine
    from mlxformer.speculative.speculator import SpeculativeSettings

    model, tokenizer = load(args.model)
    prompts = [tokenizer.encode_prompt(f"Repeat the following text exactly, word for word.\n\n{t}") for t in TEXTS]
    lm = None
    if not args.no_mlx_lm:
        import mlx_lm

        lm = mlx_lm.load(str(args.model))
    lookup = SpeculativeSettings(prompt_lookup=True, num_draft_tokens=args.num_draft_tokens)
    most = max(args.clients)
    plain_engine = Engine(model, tokenizer, max_batch=most, prefix_cache_bytes=0)
    lookup_engine = Engine(model, tokenizer, max_batch=most, prefix_cache_bytes=0, speculative=lookup)
    results: dict[str, list[float]] = {}
    acceptance: dict[int, tuple[int, int]] = {}

    def record(name: str, value: float) -> None:
        results.setdefault(name, []).append(value)
        print(f"{name}: {value:.2f} tok/s", flush=True)

    with plain_engine, lookup_engine:
        for _ in range(args.rounds):
            for c in args.clients:
                record(f"engine, {c} concurrent", engine_run(plain_engine, prompts[:c], args.tokens)[0])
                tps, proposed, accepted = engine_run(lookup_engine, prompts[:c], args.tokens)
                record(f"engine --prompt-lookup, {c} concurrent", tps)
                acceptance[c] = (accepted, proposed)
                if lm is not None:
                    record(f"mlx-lm batch_generate, {c} prompts", mlx_lm_batch(*lm, prompts[:c], args.tokens))
    print(f"\n{args.model.name}, {args.tokens} tokens per request, median of {args.rounds} rounds\n")
    print("| run | generated tok/s | vs plain engine, same concurrency |")
    print("|---|---:|---:|")
    for name, values in results.items():
        c = int(name.split(", ")[-1].split()[0])
        base = statistics.median(results[f"engine, {c} concurrent"])
        median = statistics.median(values)
        print(f"| {name} | {median:.2f} | {median / base:.2f}x |")
    for c, (accepted, proposed) in acceptance.items():
        print(f"\nprompt lookup, {c} concurrent: accepted {accepted} of {proposed} proposed tokens")


if __name__ == "__main__":
    main()
