"""The prompt cache: `mlxformer serve` beside `mlx_lm.server` on long shared prefixes.

Both servers run as subprocesses on 127.0.0.1, one at a time, on the same model files, in one
run, interleaved (ours, peer, ours, peer, ...). A request is a chat completion whose system
message is a prefix of about ``L`` tokens (the "agent system prompt"; ``--prefix-tokens``, e.g.
512 1024 2048 4096) and whose user message is a ~32-token question; TTFT is the time to the
first streamed content token (1 token generated, greedy). Measured per prefix length:

- cold (nothing cached), memory (the same prefix, another question), and disk: after a server
  restart on the same ``--prompt-cache-dir``. mlx_lm.server has no disk tier: a restart is cold
  again, so its disk point is not measured (it is its cold point);
- for the longest prefix, ``--clients`` concurrent requests sharing a fresh prefix: TTFT p50 and,
  for mlxformer, the prompt tokens run through the model (``mlxformer_prefilled_tokens_total``
  on ``/metrics``), with prefix sharing on and off (``--no-prefix-sharing``).

Quote the ratios (memory / cold, disk / cold, sharing on / off), not the absolute times, with
the load averages the JSON records. Writes ``prompt_cache.json`` and ``prompt_cache.png``.

Usage:
  python benchmarks/prepare_models.py --skip-1b     # once: writes .bench/models
  python benchmarks/prompt_cache.py [--model .bench/models/smollm2-bf16] [--prefix-tokens 512 1024 2048 4096]
  # the 2026-12-01 figures (a shared 2-core machine: the two parts as two ~15-minute runs)
  python benchmarks/prompt_cache.py --prefix-tokens 256 512 1024 --skip-concurrent
  python benchmarks/prompt_cache.py --prefix-tokens 256 512 1024 --concurrent-tokens 128 --skip-single
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
from pathlib import Path

from serving import Server, load_average, pyplot, save_figure

WORDS = ("agent tool call file edit search shell test build review plan diff commit patch branch "
         "error trace module function class argument return value config path").split()
PREFILLED = "mlxformer_prefilled_tokens_total"


def prefix_text(tokens: int, seed: int) -> str:
    """A deterministic text of about ``tokens`` tokens (SmolLM2's tokenizer: ~1 token a word);
    prefixes of different seeds differ from their first block on."""
    words = [WORDS[(i * 7 + seed * 13 + i // 5) % len(WORDS)] for i in range(tokens - 16)]
    lines = [" ".join(words[i : i + 12]) + "." for i in range(0, len(words), 12)]
    return f"Session {seed}. You are a coding agent. Rules:\n" + "\n".join(lines)


def question(i: int) -> str:
    return (f"Question {i}: given the rules above, which tool would you call first to find where the "
            f"error in module number {i} is raised, and why? Answer briefly.")


def ttft(server: Server, system: str, user: str) -> float:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return server.stream_chat(messages, 1)["ttft"]


def concurrent_ttfts(server: Server, system: str, clients: int) -> list[float]:
    results = [0.0] * clients

    def client(i: int) -> None:
        results[i] = ttft(server, system, question(100 + i))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def single_requests(server: Server, lengths: list[int], tiers: tuple[str, ...], out: dict) -> None:
    """TTFT per prefix length for ``tiers`` ("cold" then "memory", or "disk"), each its own seed."""
    ttft(server, "Hi", "Hi")  # warm-up
    for length in lengths:
        row = out.setdefault(str(length), {})
        for number, tier in enumerate(tiers):
            row[tier] = ttft(server, prefix_text(length, length), question(number + (3 if tier == "disk" else 1)))
        print(f"  {server.kind} {length}: {row}", flush=True)


def concurrent(server: Server, length: int, clients: int) -> dict:
    """TTFTs of ``clients`` requests arriving together with one ``length``-token prefix."""
    ttft(server, "Hi", "Hi")
    before = server.metric(PREFILLED)
    ttfts = concurrent_ttfts(server, prefix_text(length, 7), clients)
    after = server.metric(PREFILLED)
    return {"ttft_p50": statistics.median(ttfts), "ttfts": ttfts,
            "prefilled": None if before is None or after is None else after - before, "load": load_average()}


def run_single(args: argparse.Namespace) -> dict:
    """Cold and memory TTFT on each server, then disk on a restarted mlxformer: ours, peer, ours."""
    part: dict = {"prefix_tokens": args.prefix_tokens, "load": [load_average()], "mlxformer": {}}
    flags = ["--max-batch", str(args.clients)]
    with tempfile.TemporaryDirectory() as cache_dir:
        disk = [*flags, "--prompt-cache-dir", cache_dir]
        with Server("mlxformer", args.model, disk) as server:
            single_requests(server, args.prefix_tokens, ("cold", "memory"), part["mlxformer"])
        part["load"].append(load_average())
        if not args.skip_peer:
            part["mlx-lm"] = {}
            with Server("mlx-lm", args.model) as server:
                single_requests(server, args.prefix_tokens, ("cold", "memory"), part["mlx-lm"])
            part["load"].append(load_average())
        with Server("mlxformer", args.model, disk) as server:  # a restart: memory is empty, the files stay
            single_requests(server, args.prefix_tokens, ("disk",), part["mlxformer"])
        part["load"].append(load_average())
    return part


def run_concurrent(args: argparse.Namespace) -> dict:
    """``--clients`` requests sharing one fresh prefix: ours sharing, peer, ours not sharing."""
    length, flags = args.concurrent_tokens, ["--max-batch", str(args.clients)]
    part: dict = {"prefix_tokens": length, "clients": args.clients, "mlxformer": {}}
    with Server("mlxformer", args.model, flags) as server:
        part["mlxformer"]["shared"] = concurrent(server, length, args.clients)
    print(f"  mlxformer sharing: {part['mlxformer']['shared']}", flush=True)
    if not args.skip_peer:
        with Server("mlx-lm", args.model) as server:
            part["mlx-lm"] = {"shared": concurrent(server, length, args.clients)}
        print(f"  mlx-lm: {part['mlx-lm']['shared']}", flush=True)
    with Server("mlxformer", args.model, [*flags, "--no-prefix-sharing"]) as server:
        part["mlxformer"]["unshared"] = concurrent(server, length, args.clients)
    print(f"  mlxformer no sharing: {part['mlxformer']['unshared']}", flush=True)
    return part


def ratios(record: dict) -> dict:
    """memory / cold and disk / cold per length and server; sharing on / off; ours / mlx-lm."""
    out: dict = {}
    single = record.get("single")
    for kind in ("mlxformer", "mlx-lm") if single else ():
        for n, row in (single.get(kind) or {}).items():
            out.setdefault(kind, {})[n] = {f"{tier} / cold": row[tier] / row["cold"]
                                           for tier in ("memory", "disk") if tier in row}
    both = record.get("concurrent")
    if both:
        ours = both["mlxformer"]
        out["concurrent"] = {"mlxformer shared / unshared p50": ours["shared"]["ttft_p50"] / ours["unshared"]["ttft_p50"],
                             "prefilled shared / unshared": ours["shared"]["prefilled"] / ours["unshared"]["prefilled"]}
        if "mlx-lm" in both:
            out["concurrent"]["mlxformer shared / mlx-lm p50"] = (ours["shared"]["ttft_p50"]
                                                                  / both["mlx-lm"]["shared"]["ttft_p50"])
    return out


def plot(record: dict, path: Path) -> None:
    plt = pyplot()
    from matplotlib.ticker import ScalarFormatter

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    single, both = record.get("single"), record.get("concurrent")
    if single:
        lengths = single["prefix_tokens"]
        for index, kind in enumerate(k for k in ("mlxformer", "mlx-lm") if k in single):
            for tier, marker in (("cold", "o"), ("memory", "s"), ("disk", "^")):
                points = [(n, single[kind][str(n)][tier]) for n in lengths if tier in single[kind][str(n)]]
                if points:
                    left.plot(*zip(*points), marker=marker, linestyle="-" if kind == "mlxformer" else "--",
                              color=f"C{index}", label=f"{kind} {tier}")
        left.set_xscale("log", base=2)
        left.set_yscale("log")
        left.yaxis.set_major_formatter(ScalarFormatter())
        left.set_xticks(lengths, [str(n) for n in lengths])
        left.set_xlabel("shared prefix (tokens), + a 32-token question")
        left.set_ylabel("TTFT (s)")
        left.set_title("one request (mlx_lm.server: no disk tier)", fontsize=10)
        left.grid(alpha=0.3)
        left.legend(fontsize=7)
    if both:
        bars = [("ours, sharing", both["mlxformer"]["shared"]["ttft_p50"]),
                ("ours, no sharing", both["mlxformer"]["unshared"]["ttft_p50"])]
        if "mlx-lm" in both:
            bars.append(("mlx_lm.server", both["mlx-lm"]["shared"]["ttft_p50"]))
        right.bar([b[0] for b in bars], [b[1] for b in bars], color=["C0", "C2", "C1"][: len(bars)])
        right.set_ylabel("TTFT p50 (s)")
        right.set_title(f"{both['clients']} concurrent requests, one {both['prefix_tokens']}-token prefix", fontsize=10)
    save_figure(figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path(".bench/models/smollm2-bf16"))
    parser.add_argument("--prefix-tokens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--concurrent-tokens", type=int, help="the concurrent requests' prefix (default: the longest)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--skip-single", action="store_true", help="only the concurrent requests")
    parser.add_argument("--skip-concurrent", action="store_true", help="only the single requests")
    parser.add_argument("--skip-peer", action="store_true", help="mlxformer only")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--replot", action="store_true", help="only redraw the plot from the results JSON in --out")
    args = parser.parse_args()
    path = args.out / "prompt_cache.json"
    if args.replot:
        plot(json.loads(path.read_text()), args.out / "prompt_cache.png")
        return
    args.prefix_tokens = sorted(args.prefix_tokens)
    args.concurrent_tokens = args.concurrent_tokens or args.prefix_tokens[-1]
    # a part run alone (--skip-...) keeps the other part of an earlier run of the same model
    record = json.loads(path.read_text()) if path.exists() and (args.skip_single or args.skip_concurrent) else {}
    if record.get("model") != args.model.name:
        record = {}
    record["model"] = args.model.name
    if not args.skip_single:
        record["single"] = run_single(args)
    if not args.skip_concurrent:
        record["concurrent"] = run_concurrent(args)
    record["ratios"] = ratios(record)
    print(json.dumps(record["ratios"], indent=2))
    if "concurrent" in record:
        ours = record["concurrent"]["mlxformer"]
        print(f"prefilled tokens, {record['concurrent']['clients']} concurrent: sharing {ours['shared']['prefilled']}, "
              f"no sharing {ours['unshared']['prefilled']}")
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    plot(record, args.out / "prompt_cache.png")

if __name__ == "__main__":
    main()
