"""`mlxformer serve` beside `mlx_lm.server` on the same model files, 1/2/4/8 concurrent clients.

Both servers run with their defaults as subprocesses on 127.0.0.1, one at a time, in one run;
the order alternates per model and cache setting (A B, then B A). Each client streams one chat
completion of its own short prompt, greedy, with every EOS id biased away (``logit_bias`` -100)
so that each request generates exactly ``--max-tokens`` tokens on both servers. Reported per
server and client count: aggregate generated tokens/s (all tokens over the round's wall time,
time to first token included) and time to first token p50/p95; then the ratios the issue-32
targets name (8 clients: TTFT p50 <= mlx_lm.server's, tokens/s >= 2x; 1 client: >= 1x).
Also measured: mlxformer's own single-stream decode speed (library, no server). The plot shows
throughput and TTFT p50 against clients for both servers. With ``--kv-bits 8`` both servers
quantize their KV cache (mlx-lm then serves one request at a time).

Usage:
  python benchmarks/prepare_models.py --skip-1b     # once: writes .bench/models
  python benchmarks/serve_vs_mlx_lm.py [--models smollm2-bf16] [--ends-only smollm2-f32 smollm2-4bit] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from serving import BEFORE, KINDS, Server, concurrently, eos_ids_of, kinds, load_average, percentile, pyplot, save_figure

TOPICS = ["the sea", "a robot", "the moon", "a small town", "winter", "a dragon", "coffee", "a library"]


def server_flags(server: str, kv_bits: int | None, max_batch: int, ours: tuple[str, ...] = ()) -> list[str]:
    if server.startswith("mlxformer"):
        return ["--max-batch", str(max_batch), *ours] + (["--kv-bits", str(kv_bits)] if kv_bits else [])
    return ["--kv-bits", str(kv_bits), "--quantized-kv-start", "0"] if kv_bits else []


def run_round(server: Server, clients: int, max_tokens: int, eos_ids: list[int]) -> dict[str, float]:
    """``clients`` concurrent streams of ``max_tokens`` tokens each (EOS biased away)."""
    bias = {str(i): -100.0 for i in eos_ids}

    def client(i: int) -> dict:
        prompt = f"Write a long story about {TOPICS[i % len(TOPICS)]}."
        return server.stream_chat([{"role": "user", "content": prompt}], max_tokens, logit_bias=bias)

    cpu = server.cpu_seconds()
    results = concurrently([functools.partial(client, i) for i in range(clients)])
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    return {"tokens": sum(r["tokens"] for r in results), "wall": wall, "ttfts": [r["ttft"] for r in results],
            "cpu": server.cpu_seconds() - cpu, "load": load_average()}


def bench_server(server: str, model_dir: Path, args: argparse.Namespace, kv_bits: int | None,
                 eos_ids: list[int], clients: list[int]) -> dict[int, dict[str, float]]:
    checkout = args.baseline if server == BEFORE else None
    flags = server_flags(server, kv_bits, max(args.clients), args.ours)
    with Server(server, model_dir, flags, checkout) as running:
        running.stream_chat([{"role": "user", "content": "Hello"}], 4)  # warm-up
        return {c: run_round(running, c, args.max_tokens, eos_ids) for c in clients}


def single_stream_decode(model_dir: Path, max_tokens: int) -> float:
    """mlxformer's library decode tok/s for one stream (subprocess: its own memory and threads)."""
    code = (
        "import sys\nfrom mlxformer import load, stream_generate\n"
        f"m, t = load({str(model_dir)!r})\nids = t.encode_prompt('Write a long story about the sea.')\n"
        "list(stream_generate(m, t, ids, 4))\n"
        f"r = list(stream_generate(m, t, ids, {max_tokens}))[-1]\nprint(r.generation_tps)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def summarize(rounds: list[dict[str, float]]) -> dict[str, float]:
    ttfts = [t for r in rounds for t in r["ttfts"]]
    return {
        "tok_s": statistics.median(r["tokens"] / r["wall"] for r in rounds),
        "cpu_ms_per_token": statistics.median(1e3 * r["cpu"] / r["tokens"] for r in rounds),  # prefill included
        "ttft_p50": percentile(ttfts, 0.5), "ttft_p95": percentile(ttfts, 0.95),
        "load": [r["load"][0] for r in rounds],
    }


def plot(results: dict, clients: list[int], path: Path) -> None:
    """Aggregate tokens/s and TTFT p50 against clients, one colour per model, both servers."""
    plt = pyplot()
    figure, (throughput, ttft) = plt.subplots(1, 2, figsize=(11, 4.5))
    for index, (key, per_server) in enumerate(results.items()):
        for server, rows in per_server.items():
            style = {"mlxformer": "-o", BEFORE: ":^"}.get(server, "--s")
            measured = [c for c in clients if str(c) in rows]  # a guard model has fewer
            for axis, field in ((throughput, "tok_s"), (ttft, "ttft_p50")):
                axis.plot(measured, [rows[str(c)][field] for c in measured], style, color=f"C{index}",
                          label=f"{server} {key}")
    throughput.set_ylabel("aggregate generated tokens/s")
    ttft.set_ylabel("time to first token p50 (s, log scale)")
    ttft.set_yscale("log")
    for axis in (throughput, ttft):
        axis.set_xlabel("concurrent clients")
        axis.set_xticks(clients)
        axis.grid(alpha=0.3)
    throughput.legend(fontsize=7)
    figure.suptitle("mlxformer serve vs mlx_lm.server (SmolLM2-135M, CPU)")
    save_figure(figure, path)


def targets(results: dict, clients: list[int]) -> dict[str, dict[str, float]]:
    """Per model: the ratios issue 32 sets targets for (ours / mlx_lm.server's)."""
    out = {}
    for key, per in results.items():
        ratios = {}
        for c in (1, max(clients)):
            if str(c) in per["mlxformer"]:
                ours, theirs = per["mlxformer"][str(c)], per["mlx-lm"][str(c)]
                ratios[f"tok_s_ratio_{c}"] = round(ours["tok_s"] / theirs["tok_s"], 3)
                ratios[f"ttft_p50_ratio_{c}"] = round(ours["ttft_p50"] / theirs["ttft_p50"], 3)
                ratios[f"cpu_per_token_ratio_{c}"] = round(ours["cpu_ms_per_token"] / theirs["cpu_ms_per_token"], 3)
                if BEFORE in per:  # ours now over ours from the baseline checkout
                    before = per[BEFORE][str(c)]
                    ratios[f"tok_s_vs_before_{c}"] = round(ours["tok_s"] / before["tok_s"], 3)
                    ratios[f"ttft_p50_vs_before_{c}"] = round(ours["ttft_p50"] / before["ttft_p50"], 3)
        out[key] = ratios
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models-dir", type=Path, default=Path(".bench/models"))
    parser.add_argument("--models", nargs="+", default=["smollm2-bf16"], help="measured at every --clients count")
    parser.add_argument("--ends-only", nargs="*", default=["smollm2-f32", "smollm2-4bit"],
                        help="models measured at the fewest and the most --clients only (for time: a float32 "
                             "prefill runs on the CPU's reference BLAS, mlx-lm's 4-bit is slow on a CPU)")
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--kv-bits", nargs="+", type=int, default=[0], help="0: float KV cache (default)")
    parser.add_argument("--first", choices=KINDS, default=KINDS[0], help="the server of the first round")
    parser.add_argument("--baseline", type=Path, help="a checkout of an earlier mlxformer (e.g. `git worktree add "
                        "../before REV`), served too as mlxformer-before: a before/after in the same run")
    parser.add_argument("--ours", action="append", default=[], help="one more `mlxformer serve` flag (repeatable), e.g. --ours=--threads=1")
    parser.add_argument("--skip-single", action="store_true", help="no library single-stream decode figure")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--replot", type=Path, help="only redraw the plot from a results JSON this script wrote")
    args = parser.parse_args()
    if args.replot:
        saved = json.loads(args.replot.read_text())["results"]
        clients = sorted({int(c) for per in saved.values() for rows in per.values() for c in rows})
        plot(saved, clients, args.out / "serve_throughput.png")
        return

    start_load = load_average()
    results: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    single: dict[str, float] = {}
    servers = kinds(args.baseline)
    flip = args.first != KINDS[0]
    for name in args.models + args.ends_only:
        model_dir = args.models_dir / name
        clients = args.clients if name in args.models else sorted({min(args.clients), max(args.clients)})
        eos_ids = eos_ids_of(model_dir)
        if not args.skip_single:
            single[name] = single_stream_decode(model_dir, args.max_tokens)
        for kv_bits in args.kv_bits:
            key = f"{name}" + (f" kv{kv_bits}" if kv_bits else "")
            rounds: dict[str, dict[int, list]] = {s: {c: [] for c in clients} for s in servers}
            for _ in range(args.trials):
                order = servers[::-1] if flip else servers
                flip = not flip
                for server in order:
                    begun = time.monotonic()
                    for c, measured in bench_server(server, model_dir, args, kv_bits or None, eos_ids, clients).items():
                        rounds[server][c].append(measured)
                    print(f"{key} {server}: {time.monotonic() - begun:.0f} s", flush=True)
            results[key] = {s: {str(c): summarize(r) for c, r in per.items()} for s, per in rounds.items()}
            print(f"{key}: {json.dumps(results[key])}", flush=True)

    print(f"\n{date.today()} {platform.machine()} {platform.system()}, {args.max_tokens} tokens per client\n")
    print("| model | clients | mlxformer tok/s | mlx-lm tok/s | ratio | TTFT p50 ours / mlx-lm (s) | TTFT p95 ours / mlx-lm (s) "
          "| server CPU ms/token ours / mlx-lm |")
    print("|---|---|---|---|---|---|---|---|")
    for key, per in results.items():
        for c in (c for c in args.clients if str(c) in per["mlxformer"]):
            ours, theirs = per["mlxformer"][str(c)], per["mlx-lm"][str(c)]
            print(f"| {key} | {c} | {ours['tok_s']:.1f} | {theirs['tok_s']:.1f} | {ours['tok_s'] / theirs['tok_s']:.2f}x "
                  f"| {ours['ttft_p50']:.2f} / {theirs['ttft_p50']:.2f} | {ours['ttft_p95']:.2f} / {theirs['ttft_p95']:.2f} "
                  f"| {ours['cpu_ms_per_token']:.0f} / {theirs['cpu_ms_per_token']:.0f} |")
    ratios = targets(results, args.clients)
    print("\nissue 32 (ours / mlx_lm.server; targets at 8 clients: TTFT p50 <= 1, tok/s >= 2; 1 client tok/s >= 1):")
    for key, per in ratios.items():
        print(f"  {key}: {per}")
    print(f"\nload average {start_load} at the start, {load_average()} at the end")
    print("mlxformer single-stream decode (library): "
          + ", ".join(f"{k}: {v:.1f} tok/s" for k, v in single.items()))
    for key, per in results.items():
        name = key.split()[0]
        if name not in single:
            continue
        top = per["mlxformer"][str(max(args.clients))]["tok_s"]
        print(f"{key}: {max(args.clients)} clients / single stream = {top / single[name]:.2f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_vs_mlx_lm.json").write_text(json.dumps({
        "date": str(date.today()), "max_tokens": args.max_tokens, "load_start": start_load,
        "load_end": load_average(), "results": results, "targets": ratios, "single_stream": single}, indent=2))
    plot(results, args.clients, args.out / "serve_throughput.png")


if __name__ == "__main__":
    main()
