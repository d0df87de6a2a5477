"""What the serving benchmarks share: server subprocesses, streamed chat requests, concurrent
clients, a watcher of the server's memory and metrics, prompts of a given length, plots, load.

``serve_vs_mlx_lm.py``, ``serve_head_of_line.py``, ``serve_kv_budget.py`` and ``prompt_cache.py``
run `mlxformer serve` and `mlx_lm.server` as subprocesses on 127.0.0.1 (one at a time), stream
OpenAI chat completions at them and time the first content token.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.client import HTTPConnection
from pathlib import Path
from typing import Any, Callable, TypeVar

T = TypeVar("T")

START_TIMEOUT_SECONDS = 300
KINDS = ("mlxformer", "mlx-lm")
BEFORE = "mlxformer-before"  # `mlxformer serve` from another checkout (``--baseline``): a before/after in one run


def kinds(baseline: Path | None) -> tuple[str, ...]:
    """The servers a run measures: ours, ours from the ``baseline`` checkout if given, mlx-lm's."""
    return (KINDS[0], BEFORE, KINDS[1]) if baseline else KINDS


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load_average() -> list[float]:
    """The machine's 1/5/15-minute load averages (the benchmarks quote them beside ratios)."""
    return [round(x, 2) for x in os.getloadavg()]


def server_command(kind: str, model_dir: Path, port: int, extra: list[str]) -> list[str]:
    """The command line of one ``kind`` server on ``model_dir`` (``extra``: its own flags)."""
    if kind.startswith("mlxformer"):
        return [sys.executable, "-m", "mlxformer", "serve", "--model", str(model_dir.resolve()), "--port", str(port), *extra]
    return [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir.resolve()), "--port", str(port),
            "--log-level", "WARNING", *extra]


class Server:
    """One server subprocess: started and healthy on enter, stopped (terminate, then kill) on exit."""

    def __init__(self, kind: str, model_dir: Path, extra: list[str] | None = None, checkout: Path | None = None) -> None:
        self.kind, self.port = kind, free_port()
        self.command = server_command(kind, model_dir, self.port, extra or [])
        self.name = model_dir.name if kind.startswith("mlxformer") else "default_model"  # the served model's name
        self.checkout = checkout.resolve() if checkout else None  # where to run it from (None: here)

    def __enter__(self) -> "Server":
        if threading.current_thread() is threading.main_thread():  # a SIGTERM (e.g. timeout) stops the server too
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        # a checkout's package first (``-m`` puts the working directory first on the path)
        env = {**os.environ, "PYTHONPATH": str(self.checkout)} if self.checkout else None
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        env=env, cwd=self.checkout)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"{self.kind} server exited with {self.process.returncode}")
            try:
                connection = HTTPConnection("127.0.0.1", self.port, timeout=5)
                connection.request("GET", "/health")
                if connection.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{self.kind} server did not start in {START_TIMEOUT_SECONDS} s")

    def stream_chat(self, messages: list[dict[str, str]], max_tokens: int, **body: Any) -> dict[str, float]:
        """One streamed greedy chat completion: ``ttft`` (s), generated ``tokens``, ``start``/``end``
        (``time.perf_counter``), the reply's ``text`` and the last ``usage`` sent."""
        request = {"model": self.name, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                   "stream": True, "stream_options": {"include_usage": True}, **body}
        connection = HTTPConnection("127.0.0.1", self.port, timeout=3600)
        start = time.perf_counter()
        connection.request("POST", "/v1/chat/completions", json.dumps(request), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise SystemExit(f"{self.kind}: {response.status} {response.read()[:500]!r}")
        first, tokens, chunks, pieces, usage = None, 0, 0, [], {}
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                if content := (choice.get("delta") or {}).get("content"):
                    pieces.append(content)
                    chunks += 1
                    first = first or time.perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"]
                tokens = usage["completion_tokens"]
        end = time.perf_counter()
        connection.close()
        return {"ttft": (first or end) - start, "tokens": tokens or chunks, "start": start, "end": end,
                "text": "".join(pieces), "usage": usage}

    def metric(self, name: str) -> float | None:
        """One unlabelled counter or gauge from ``/metrics`` (mlxformer only; None if absent)."""
        return self.metrics((name,)).get(name)

    def metrics(self, names: tuple[str, ...]) -> dict[str, float]:
        """The unlabelled counters and gauges ``names`` found in one ``/metrics`` scrape (mlxformer only)."""
        if not self.kind.startswith("mlxformer"):
            return {}
        connection = HTTPConnection("127.0.0.1", self.port, timeout=60)
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
        connection.close()
        found = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in names:
                found[name] = float(value)
        return found

    def cpu_seconds(self) -> float:
        """The server process's CPU time so far, all its threads, user and system (Linux): on a
        machine shared with other work, CPU per token compares servers where wall time does not."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)

    def rss(self) -> tuple[int, int]:
        """The server process's resident set now and its peak (``VmRSS``, ``VmHWM``), in bytes (Linux)."""
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines())
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024

    def reset_peak_rss(self) -> None:
        """Start the peak (``VmHWM``) over from the RSS now (Linux's ``clear_refs`` 5)."""
        Path(f"/proc/{self.process.pid}/clear_refs").write_text("5")


class Watcher:
    """Samples a server's ``/metrics`` gauges ``names`` and its RSS every ``period`` seconds on a
    thread while the block runs; ``peaks`` holds each one's largest value (``rss``: bytes)."""

    def __init__(self, server: Server, names: tuple[str, ...], period: float = 0.1) -> None:
        self.server, self.names, self.period = server, names, period
        self.peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        values = {**self.server.metrics(self.names), "rss": float(self.server.rss()[0])}
        for name, value in values.items():
            self.peaks[name] = max(value, self.peaks.get(name, value))

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def __enter__(self) -> "Watcher":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def concurrently(calls: list[Callable[[], T]]) -> list[T]:
    """Run ``calls`` at once, one thread each; their results in order (the first error is raised)."""
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def eos_ids_of(model_dir: Path) -> list[int]:
    """The model's end-of-sequence token ids (biased away so that every reply has its full length)."""
    from mlxformer.text.tokenizer import load_tokenizer_from_dir

    return load_tokenizer_from_dir(model_dir).eos_token_ids


def text_of_tokens(model_dir: Path, tokens: int, seed: int = 0) -> str:
    """A user message of about ``tokens`` tokens for ``model_dir``'s tokenizer: ordinary words,
    shuffled by ``seed`` (so that two prompts share no prefix beyond the chat template's)."""
    import random

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    words = ("river stone market lantern garden winter copper violin harbor meadow signal orchard "
             "thunder pocket ladder candle forest mirror engine saddle").split()
    rng = random.Random(seed)
    text = ""
    while len(tokenizer.encode(text)) < tokens:
        text += " ".join(rng.choice(words) for _ in range(max(8, (tokens - len(tokenizer.encode(text))) // 2))) + ". "
    return text


def save_figure(figure: Any, path: Path) -> None:
    """Write a matplotlib figure as a small PNG."""
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (the ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
