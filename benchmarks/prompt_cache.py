"""The prompt cache: `mlxformer serve` beside `mlx_lm.server` on a long shared prefix.

Each server runs as a subprocess on 127.0.0.1, on the same model files, in one run. A request is
a chat completion whose system message is a ``--prefix-tokens``-token text (the "agent system
prompt") and whose user message is a short question (~32 tokens); TTFT is the time to the first
streamed content token (1 token generated, greedy). Measured:

- single requests: cold (nothing cached), warm (the same prefix, another question: memory), and
  after a server restart on the same ``--prompt-cache-dir`` (disk; mlx_lm.server has no disk
  tier, so its "restart" is cold again);
- 8 concurrent requests sharing a fresh prefix: TTFT p50, and for mlxformer the prompt tokens
  prefilled per ``/metrics`` (``mlxformer_prefilled_tokens_total``), with prefix sharing on
  and off (``--no-prefix-sharing``).

Quote the ratios (warm / cold, disk / cold, sharing on / off), not the absolute times: the
machine may be shared. Writes ``benchmarks/results/prompt_cache.json`` and ``prompt_cache.png``.

Usage:
  python benchmarks/prepare_models.py --skip-1b     # once: writes .bench/models
  python benchmarks/prompt_cache.py [--model .bench/models/smollm2-f32] [--prefix-tokens 4096]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.client import HTTPConnection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve_vs_mlx_lm import free_port, wait_healthy  # noqa: E402

WORDS = ("agent tool call file edit search shell test build review plan diff commit patch branch "
         "error trace module function class argument return value config path").split()


def prefix_text(tokens: int, seed: int) -> str:
    """A deterministic text of roughly ``tokens`` tokens (SmolLM2's tokenizer: ~1 token a word)."""
    words = [WORDS[(i * 7 + seed * 13 + i // 5) % len(WORDS)] for i in range(tokens)]
    lines = [" ".join(words[i : i + 12]) + "." for i in range(0, len(words), 12)]
    return f"Session {seed}. You are a coding agent. Rules:\n" + "\n".join(lines)


def question(i: int) -> str:
    return (f"Question {i}: given the rules above, which tool would you call first to find where the "
            f"error in module number {i} is raised, and why? Answer briefly.")


class Server:
    """One server subprocess (started on enter, stopped on exit)."""

    def __init__(self, kind: str, model: Path, extra: list[str]) -> None:
        self.kind, self.port = kind, free_port()
        if kind == "mlxformer":
            command = [sys.executable, "-m", "mlxformer", "serve", "--model", str(model), "--port", str(self.port),
                       "--max-batch", "8", *extra]
            self.name = model.name  # a local folder is served under its name
        else:
            command = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model), "--port", str(self.port),
                       "--log-level", "WARNING", *extra]
            self.name = "default_model"
        self.command = command

    def __enter__(self) -> "Server":
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_healthy(self.port, self.process)
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def ttft(self, system: str, user: str) -> float:
        """Seconds to the first streamed content token of one greedy chat request."""
        body = {"model": self.name, "messages": [{"role": "system", "content": system},
                                                 {"role": "user", "content": user}],
                "max_tokens": 1, "temperature": 0.0, "stream": True}
        connection = HTTPConnection("127.0.0.1", self.port, timeout=3600)
        start = time.perf_counter()
        connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise SystemExit(f"{self.kind}: {response.status} {response.read()[:300]!r}")
        first = None
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: {") and first is None:
                chunk = json.loads(line[6:])
                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                    first = time.perf_counter()
        connection.close()
        return (first or time.perf_counter()) - start

    def prefilled(self) -> float | None:
        """mlxformer's count of prompt tokens run through the model, from ``/metrics``."""
        if self.kind != "mlxformer":
            return None
        connection = HTTPConnection("127.0.0.1", self.port, timeout=60)
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        text = response.read().decode()
        connection.close()
        match = re.search(r"^mlxformer_prefilled_tokens_total (\S+)$", text, flags=re.M)
        return float(match.group(1)) if response.status == 200 and match else None


def concurrent_ttfts(server: Server, system: str, clients: int) -> list[float]:
    results = [0.0] * clients

    def client(i: int) -> None:
        results[i] = server.ttft(system, question(100 + i))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def run_mlxformer(model: Path, args: argparse.Namespace, out: dict) -> None:
    with tempfile.TemporaryDirectory() as cache_dir:
        flags = ["--prompt-cache-dir", cache_dir]
        prefix = prefix_text(args.prefix_tokens, 1)
        with Server("mlxformer", model, flags) as server:
            server.ttft("Hi", "Hi")  # warm-up
            out["cold"] = server.ttft(prefix, question(1))
            out["memory"] = server.ttft(prefix, question(2))
        with Server("mlxformer", model, flags) as server:
            server.ttft("Hi", "Hi")
            out["disk"] = server.ttft(prefix, question(3))
    for sharing in (True, False):
        key = "shared" if sharing else "unshared"
        with Server("mlxformer", model, [] if sharing else ["--no-prefix-sharing"]) as server:
            server.ttft("Hi", "Hi")
            before = server.prefilled()
            ttfts = concurrent_ttfts(server, prefix_text(args.prefix_tokens, 2), args.clients)
            after = server.prefilled()
        out[key] = {"ttft_p50": statistics.median(ttfts),
                    "prefilled": None if before is None or after is None else after - before}


def run_mlx_lm(model: Path, args: argparse.Namespace, out: dict) -> None:
    prefix = prefix_text(args.prefix_tokens, 1)
    with Server("mlx-lm", model, []) as server:
        server.ttft("Hi", "Hi")
        out["cold"] = server.ttft(prefix, question(1))
        out["memory"] = server.ttft(prefix, question(2))
    with Server("mlx-lm", model, []) as server:
        server.ttft("Hi", "Hi")
        out["disk"] = server.ttft(prefix, question(3))  # no disk tier: cold again
        out["shared"] = {"ttft_p50": statistics.median(concurrent_ttfts(server, prefix_text(args.prefix_tokens, 2),
                                                                        args.clients)), "prefilled": None}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    labels = ["cold", "memory", "disk (restart)"]
    for offset, (server, rows) in enumerate(results.items()):
        values = [rows["cold"], rows["memory"], rows["disk"]]
        left.bar([i + 0.38 * offset for i in range(3)], values, width=0.38, label=server)
    left.set_xticks([i + 0.19 for i in range(3)], labels)
    left.set_ylabel("TTFT (s)")
    left.set_title("one request, long shared prefix")
    left.legend()
    bars = [("mlxformer sharing", results["mlxformer"]["shared"]["ttft_p50"]),
            ("mlxformer no sharing", results["mlxformer"]["unshared"]["ttft_p50"]),
            ("mlx_lm.server", results["mlx-lm"]["shared"]["ttft_p50"])]
    right.bar([b[0] for b in bars], [b[1] for b in bars], color=["C0", "C2", "C1"])
    right.set_ylabel("TTFT p50 (s)")
    right.set_title("8 concurrent requests, one shared prefix")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path(".bench/models/smollm2-f32"))
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    results: dict[str, dict] = {"mlxformer": {}, "mlx-lm": {}}
    run_mlxformer(args.model, args, results["mlxformer"])
    run_mlx_lm(args.model, args, results["mlx-lm"])
    for server, rows in results.items():
        print(f"{server}: memory/cold {rows['memory'] / rows['cold']:.3f}, disk/cold {rows['disk'] / rows['cold']:.3f}")
    ours = results["mlxformer"]
    print(f"mlxformer {args.clients} concurrent: TTFT p50 sharing/no sharing "
          f"{ours['shared']['ttft_p50'] / ours['unshared']['ttft_p50']:.3f}; prefilled tokens "
          f"{ours['shared']['prefilled']} vs {ours['unshared']['prefilled']}; vs mlx_lm.server p50 "
          f"{ours['shared']['ttft_p50'] / results['mlx-lm']['shared']['ttft_p50']:.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prompt_cache.json").write_text(json.dumps({"prefix_tokens": args.prefix_tokens, **results}, indent=2))
    plot(results, args.out / "prompt_cache.png")


if __name__ == "__main__":
    main()
