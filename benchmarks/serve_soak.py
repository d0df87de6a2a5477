"""Soak: `mlxformer serve` over SmolLM2 under 16 concurrent clients and a few hundred mixed
requests, then what the KV budget and its preemptions cost in throughput.

Soak: one server (127.0.0.1, subprocess), 16 client threads drawing from one shuffled list of
requests: chat, completions, Responses (openai client) and Anthropic Messages (httpx), each
streamed or not, some cancelled after their first chunks, some json_schema-constrained, some
with logprobs. Reported: 5xx answers (must be 0), in-band stream errors, the server's RSS
sampled every 0.5 s with the KV bytes the engine holds (``mlxformer_kv_bytes_used`` on
``/metrics``: sequences and the prompt cache, which fills towards its budget as distinct
prompts arrive) and MLX's freed-buffer cache (``mlxformer_mlx_cache_bytes``: buffers kept for
reuse, which fill as new shapes come), and the drift after warm-up (the first 20% of requests)
of the RSS and of the rest of it (RSS − KV bytes − MLX's cache: what a leak would move): the median of the last fifth
of the samples against the median of the first fifth, and their spread (must stay within 5%).

Budget: a second server with ``--max-kv-memory`` set to 10 KV blocks (8 clients each hold one
block after prefill and need a second as they generate past it; the engine admits the three whose
batch can grow by a block beside its old buffers, the rest wait; preemptions are counted from
``/metrics``). Rounds of 8 clients (each a long prompt, greedy, EOS biased away so each makes
exactly ``--budget-tokens`` tokens) alternate between the two servers (A B B A ...), each round
with new prompts: the budget also bounds the prompt cache, which could otherwise serve a
repeated round from memory on one server only. Reported: aggregate generated tokens/s of each
and their ratio (budget / none).

Usage: python benchmarks/serve_soak.py [--requests 96] [--rounds 2 (0: no budget rounds)] [--prompt-cache-bytes N]
       [--out benchmarks/results/serve_soak.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import date
from pathlib import Path

import httpx
import openai
import psutil

TOPICS = ["the sea", "a robot", "the moon", "a small town", "winter", "a dragon", "coffee", "a library",
          "a river", "an old clock", "the desert", "a lighthouse", "rain", "a garden", "a train", "the stars"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
KINDS = ["chat", "chat_stream", "completion", "completion_stream", "responses", "responses_stream",
         "messages", "messages_stream", "cancelled", "json_schema", "logprobs"]
START_TIMEOUT_SECONDS = 300
SERVED = {"name": "m"}  # the served model id, read from /v1/models at start


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: Path, max_batch: int, kv_memory: int | None, log: Path,
                 prompt_cache_bytes: int | None = None) -> tuple[subprocess.Popen, str]:
    """A server subprocess (its output to ``log``: a pipe nobody reads would fill and block it)."""
    port = free_port()
    command = [sys.executable, "-m", "mlxformer", "serve", "--model", str(model), "--port", str(port),
               "--max-batch", str(max_batch)] + (["--max-kv-memory", str(kv_memory)] if kv_memory else [])
    command += ["--prompt-cache-bytes", str(prompt_cache_bytes)] if prompt_cache_bytes is not None else []
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                SERVED["name"] = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit("server did not start")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class Tally:
    """Outcomes of the soak's requests, shared by the client threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.statuses: dict[str, int] = {}
        self.stream_errors = 0
        self.done = 0

    def add(self, status: int | str, stream_error: bool = False) -> None:
        with self.lock:
            self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1
            self.stream_errors += stream_error
            self.done += 1


def sse_has_error(lines: list[str]) -> bool:
    return any(line.startswith("event: error") or '"error"' in line[:40] for line in lines)


def one_request(kind: str, topic: str, url: str, client: openai.OpenAI, http: httpx.Client, tokens: int) -> tuple[int, bool]:
    """Send one request of ``kind``; ``(HTTP status, an error arrived in the stream)``."""
    chat = [{"role": "user", "content": f"Write one sentence about {topic}."}]
    try:
        if kind in ("chat", "chat_stream", "json_schema", "logprobs"):
            extra: dict = {}
            if kind == "json_schema":
                extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
                tokens = 40
            if kind == "logprobs":
                extra.update(logprobs=True, top_logprobs=3)
            if kind == "chat_stream":
                chunks = list(client.chat.completions.create(model=SERVED["name"], messages=chat, max_tokens=tokens, stream=True,
                                                             stream_options={"include_usage": True}))
                return 200, not chunks or chunks[-1].usage is None
            client.chat.completions.create(model=SERVED["name"], messages=chat, max_tokens=tokens, **extra)
        elif kind in ("completion", "completion_stream"):
            prompt = f"A short note about {topic}:"
            if kind == "completion_stream":
                list(client.completions.create(model=SERVED["name"], prompt=prompt, max_tokens=tokens, stream=True))
            else:
                client.completions.create(model=SERVED["name"], prompt=prompt, max_tokens=tokens, logprobs=2)
        elif kind in ("responses", "responses_stream"):
            if kind == "responses_stream":
                events = list(client.responses.create(model=SERVED["name"], input=chat[0]["content"], max_output_tokens=tokens,
                                                      stream=True))
                return 200, events[-1].type not in ("response.completed", "response.incomplete")
            client.responses.create(model=SERVED["name"], input=chat[0]["content"], max_output_tokens=tokens)
        elif kind in ("messages", "messages_stream"):
            body = {"model": SERVED["name"], "max_tokens": tokens, "messages": chat, "stream": kind == "messages_stream"}
            if kind == "messages":
                reply = http.post(url + "/v1/messages", json=body)
                return reply.status_code, False
            with http.stream("POST", url + "/v1/messages", json=body) as reply:
                lines = list(reply.iter_lines())
                return reply.status_code, sse_has_error(lines)
        elif kind == "cancelled":  # a client that goes away after its first chunks
            body = {"model": SERVED["name"], "messages": chat, "max_tokens": 200, "stream": True}
            with http.stream("POST", url + "/v1/chat/completions", json=body) as reply:
                for i, _ in enumerate(reply.iter_lines()):
                    if i >= 6:
                        break
                return reply.status_code, False
        return 200, False
    except openai.APIStatusError as exc:
        return exc.status_code, False


GAUGES = ("mlxformer_kv_bytes_used", "mlxformer_mlx_cache_bytes", "mlxformer_mlx_active_bytes")


def gauges(client: httpx.Client, url: str) -> list[int]:
    """The engine's KV bytes held, MLX's freed-buffer cache and live bytes from ``/metrics``
    (zeros if it does not answer)."""
    try:
        text = client.get(url + "/metrics").text
    except httpx.HTTPError:
        return [0] * len(GAUGES)
    values = {line.split()[0]: int(float(line.split()[1])) for line in text.splitlines()
              if line.split(" ", 1)[0] in GAUGES}
    return [values.get(name, 0) for name in GAUGES]


def soak(url: str, pid: int, requests: int, clients: int, tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    work = [(KINDS[i % len(KINDS)], rng.choice(TOPICS)) for i in range(requests)]
    rng.shuffle(work)
    tally, samples, stop = Tally(), [], threading.Event()
    lock = threading.Lock()
    process = psutil.Process(pid)
    start = time.monotonic()

    def sample() -> None:
        with httpx.Client(timeout=60) as metrics:
            while not stop.is_set():
                rss = process.memory_info().rss
                samples.append((time.monotonic() - start, rss, tally.done, *gauges(metrics, url)))
                stop.wait(0.5)

    def client_loop() -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        with httpx.Client(timeout=600) as http:
            while True:
                with lock:
                    if not work:
                        return
                    kind, topic = work.pop()
                status, in_band = one_request(kind, topic, url, client, http, tokens)
                tally.add(status, in_band)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    sampler.join()
    warm = [s for s in samples if s[2] >= requests // 5]
    fifth = max(1, len(warm) // 5)
    first, last = statistics.median(s[1] for s in warm[:fifth]), statistics.median(s[1] for s in warm[-fifth:])
    after = [s[1] for s in warm]
    beside = [s[1] - s[3] - s[4] for s in warm]  # RSS less the KV bytes held and MLX's buffer cache
    beside_first, beside_last = statistics.median(beside[:fifth]), statistics.median(beside[-fifth:])
    median_mb = lambda index, part: round(statistics.median(s[index] for s in part) / 2**20, 1)  # noqa: E731
    return {
        "requests": requests, "clients": clients, "seconds": round(time.monotonic() - start, 1),
        "statuses": tally.statuses, "server_errors_5xx": sum(v for k, v in tally.statuses.items() if k.startswith("5")),
        "in_band_stream_errors": tally.stream_errors,
        "rss_mb_after_warmup_first": round(first / 2**20, 1), "rss_mb_after_warmup_last": round(last / 2**20, 1),
        "rss_drift": round(last / first - 1, 4), "rss_spread": round(max(after) / min(after) - 1, 4),
        "kv_mb_after_warmup_first": median_mb(3, warm[:fifth]), "kv_mb_after_warmup_last": median_mb(3, warm[-fifth:]),
        "mlx_cache_mb_after_warmup_first": median_mb(4, warm[:fifth]),
        "mlx_cache_mb_after_warmup_last": median_mb(4, warm[-fifth:]),
        "mlx_active_mb_after_warmup_first": median_mb(5, warm[:fifth]),
        "mlx_active_mb_after_warmup_last": median_mb(5, warm[-fifth:]),
        "rss_rest_drift": round(beside_last / beside_first - 1, 4),
        "rss_rest_spread": round(max(beside) / min(beside) - 1, 4),
        "rss_samples": [(round(t, 2), *rest) for t, *rest in samples],
    }


def budget_round(url: str, clients: int, tokens: int, prompts: list[str], eos_bias: dict[str, int]) -> float:
    """Aggregate generated tokens/s of ``clients`` concurrent greedy chat completions."""
    totals = [0] * clients

    def one(i: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
        reply = client.chat.completions.create(model=SERVED["name"], messages=[{"role": "user", "content": prompts[i]}],
                                               max_tokens=tokens, temperature=0, logit_bias=eos_bias)
        totals[i] = reply.usage.completion_tokens

    start = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(totals) / (time.monotonic() - start)


def preemptions(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("mlxformer_preemptions_total"):
            return float(line.split()[-1])
    return 0.0


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` atomically."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def plot(samples: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.5))
    axis.plot([s[0] for s in samples], [s[1] / 2**20 for s in samples], label="RSS")
    axis.plot([s[0] for s in samples], [s[3] / 2**20 for s in samples], label="KV bytes held (sequences + prompt cache)")
    axis.plot([s[0] for s in samples], [s[4] / 2**20 for s in samples], label="MLX's freed-buffer cache")
    axis.plot([s[0] for s in samples], [(s[1] - s[3] - s[4]) / 2**20 for s in samples], label="RSS - KV - MLX cache")
    axis.set_xlabel("seconds"), axis.set_ylabel("MiB"), axis.set_title("serve_soak: server memory over time")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=8, help="max_tokens of the soak's requests")
    parser.add_argument("--rounds", type=int, default=2, help="budget rounds per server")
    parser.add_argument("--budget-tokens", type=int, default=16)
    parser.add_argument("--prompt-cache-bytes", type=int,
                        help="the soak server's prompt-cache memory (default the server's, 512 MiB, which the soak's "
                             "distinct prompts keep filling; a small one is full after warm-up)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/serve_soak.json"))
    args = parser.parse_args()

    from mlxformer import load
    from mlxformer.cache import CacheSettings
    from mlxformer.default_model import default_model_path
    from mlxformer.engine.memory import BLOCK, KVSizer

    model_path = default_model_path()
    model, tokenizer = load(model_path)
    block = KVSizer(model, CacheSettings()).bytes_for(BLOCK)
    kv_memory = 10 * block  # 8 sequences of one block each fit, 3 with room for their second
    eos_bias = {str(i): -100 for i in tokenizer.eos_token_ids}
    filler = " ".join(f"{t}." for t in TOPICS) * 4
    prompts = []
    for i in range(8):  # each prompt ends just short of one block: the reply crosses into a second
        words = f"Topic {i}: {TOPICS[i]}. {filler}".split()
        while len(tokenizer.encode(" ".join(words) + " Write about it.")) > BLOCK - args.budget_tokens // 2:
            words.pop()
        prompts.append(" ".join(words) + " Write about it.")
    del model

    load_before = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plain, plain_url = start_server(model_path, 8, None, args.out.with_suffix(".none.log"), args.prompt_cache_bytes)
    tight, tight_url = (start_server(model_path, 8, kv_memory, args.out.with_suffix(".budget.log")) if args.rounds
                        else (None, ""))
    print(f"servers up; soak: {args.requests} requests, {args.clients} clients", file=sys.stderr, flush=True)
    try:
        result = {"date": str(date.today()), "model": model_path.name, "cpus": os.cpu_count(),
                  "prompt_cache_bytes": args.prompt_cache_bytes, "load_average_before": [round(x, 2) for x in load_before]}
        result["soak"] = soak(plain_url, plain.pid, args.requests, args.clients, args.tokens, seed=0)
        write_json(args.out.with_suffix(".soak.json"), result)  # kept if the budget rounds are cut short
        print(f"soak done in {result['soak']['seconds']} s", file=sys.stderr, flush=True)
        if args.rounds:
            result["budget"] = budget_rounds(plain_url, tight_url, args.rounds, args.budget_tokens, prompts, eos_bias,
                                             kv_memory, block)
        result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    finally:
        stop_server(plain)
        if tight is not None:
            stop_server(tight)
    samples = result["soak"].pop("rss_samples")
    plot(samples, args.out.with_suffix(".png"))
    write_json(args.out, {**result, "rss_samples": samples})
    print(json.dumps(result, indent=1))
    soaked = result["soak"]
    ok = soaked["server_errors_5xx"] == 0 and abs(soaked["rss_rest_drift"]) <= 0.05
    print(f"5xx: {soaked['server_errors_5xx']}, after warm-up: RSS drift {soaked['rss_drift']:+.1%}, KV bytes held "
          f"{soaked['kv_mb_after_warmup_first']} -> {soaked['kv_mb_after_warmup_last']} MiB, MLX buffer cache "
          f"{soaked['mlx_cache_mb_after_warmup_first']} -> {soaked['mlx_cache_mb_after_warmup_last']} MiB, the rest of the RSS "
          f"drift {soaked['rss_rest_drift']:+.1%} (spread {soaked['rss_rest_spread']:.1%})")
    if "budget" in result:
        print(f"budget/none throughput at 8 clients: {result['budget']['ratio_budget_over_none']:.2f} "
              f"({result['budget']['preemptions']:.0f} preemptions)")
    sys.exit(0 if ok else 1)


def budget_rounds(plain_url: str, tight_url: str, rounds: int, tokens: int, prompts: list[str],
                  eos_bias: dict[str, int], kv_memory: int, block: int) -> dict:
    """Rounds of 8 clients alternating between the server without a budget and the one with."""
    rates: dict[str, list[float]] = {"none": [], "budget": []}
    order = [("none", plain_url), ("budget", tight_url)]
    budget_round(plain_url, 8, 4, prompts, eos_bias)  # warm-up: both servers compile their shapes
    budget_round(tight_url, 8, 4, prompts, eos_bias)
    before = preemptions(tight_url)
    for r in range(rounds):
        fresh = [f"Round {r}. {p}" for p in prompts]  # neither server has them cached: the rounds time
        for name, url in order if r % 2 == 0 else order[::-1]:  # scheduling, not the prompt cache's reach
            rates[name].append(budget_round(url, 8, tokens, fresh, eos_bias))
    return {
        "max_kv_memory": kv_memory, "block_bytes": block, "clients": 8, "tokens_each": tokens,
        "prompts": "new each round (no prompt-cache hits on either server)",
        "tokens_per_s_none": [round(x, 2) for x in rates["none"]],
        "tokens_per_s_budget": [round(x, 2) for x in rates["budget"]],
        "ratio_budget_over_none": round(statistics.mean(rates["budget"]) / statistics.mean(rates["none"]), 3),
        "preemptions": preemptions(tight_url) - before,
    }


if __name__ == "__main__":
    main()
