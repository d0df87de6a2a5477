"""Head-of-line blocking, `mlxformer serve` beside `mlx_lm.server` (each with its defaults).

A long prompt (``--long`` tokens, default 3,000) is sent, and ``--delay`` seconds later, while
it prefills, a short one ("Hi there ..."); each one's time to first token is taken from its own
send. Reported per server: the short request's TTFT as a fraction of the long one's (issue 32:
<= 0.1; 1.0 when a scheduler finishes one prompt before it starts the next), and the short
request's TTFT alone (sent to the idle server first). Each trial uses new prompts (no
prompt-cache hit on either server); the servers alternate A B, B A across trials.

Usage: python benchmarks/serve_head_of_line.py [--model smollm2-bf16] [--long 3000] [--trials 2]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from datetime import date
from pathlib import Path

from serving import BEFORE, Server, concurrently, kinds, load_average, text_of_tokens


def sent_after(delay: float, call: functools.partial) -> dict[str, float]:
    """``call()`` once ``delay`` seconds have passed."""
    time.sleep(delay)
    return call()


def trial(server: Server, long_text: str, n: int, args: argparse.Namespace) -> dict[str, float]:
    """One head-of-line measurement on a running server: the short alone, then long + short."""
    short = [{"role": "user", "content": f"Hi there, {n}!"}]
    alone = server.stream_chat([{"role": "user", "content": f"Hello, {n}!"}], args.max_tokens)["ttft"]
    long, behind = concurrently([
        functools.partial(server.stream_chat, [{"role": "user", "content": long_text}], args.max_tokens),
        functools.partial(sent_after, args.delay, functools.partial(server.stream_chat, short, args.max_tokens)),
    ])
    return {"long_ttft": long["ttft"], "short_ttft": behind["ttft"], "short_alone_ttft": alone,
            "short_over_long": behind["ttft"] / long["ttft"], "load": load_average()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models-dir", type=Path, default=Path(".bench/models"))
    parser.add_argument("--model", default="smollm2-bf16")
    parser.add_argument("--long", type=int, default=3000, help="long prompt tokens")
    parser.add_argument("--delay", type=float, default=0.3, help="seconds between the long and the short request")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--baseline", type=Path, help="a checkout of an earlier mlxformer, served too as "
                        "mlxformer-before (a before/after in the same run)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    servers = kinds(args.baseline)
    model_dir = args.models_dir / args.model
    start_load = load_average()
    rounds: dict[str, list[dict[str, float]]] = {s: [] for s in servers}
    texts = [text_of_tokens(model_dir, args.long, seed=n) for n in range(args.trials)]
    for n in range(args.trials):
        for kind in (servers if n % 2 == 0 else servers[::-1]):
            with Server(kind, model_dir, checkout=args.baseline if kind == BEFORE else None) as running:
                running.stream_chat([{"role": "user", "content": "Hello"}], 2)  # warm-up
                rounds[kind].append(trial(running, texts[n], n, args))
                print(f"{kind} trial {n}: {json.dumps(rounds[kind][-1])}", flush=True)
    summary = {kind: {field: round(statistics.median(r[field] for r in runs), 3)
                      for field in ("long_ttft", "short_ttft", "short_alone_ttft", "short_over_long")}
               for kind, runs in rounds.items()}
    print(f"\n{args.model}, long prompt ~{args.long} tokens, short sent {args.delay} s after it, "
          f"median of {args.trials} trials (issue 32: short / long <= 0.1)\n")
    print("| server | long TTFT (s) | short TTFT behind it (s) | short / long | short alone (s) |")
    print("|---|---:|---:|---:|---:|")
    for kind, row in summary.items():
        print(f"| {kind} | {row['long_ttft']:.2f} | {row['short_ttft']:.2f} | {row['short_over_long']:.3f} "
              f"| {row['short_alone_ttft']:.2f} |")
    print(f"\nload average {start_load} at the start, {load_average()} at the end")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_head_of_line.json").write_text(json.dumps({
        "date": str(date.today()), "model": args.model, "long_tokens": args.long, "delay": args.delay,
        "load_start": start_load, "load_end": load_average(), "summary": summary, "trials": rounds}, indent=2))


if __name__ == "__main__":
    main()
