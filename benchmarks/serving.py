"""What the serving benchmarks share: server subprocesses, streamed chat requests, plots, load.

``serve_vs_mlx_lm.py`` and ``prompt_cache.py`` run `mlxformer serve` and `mlx_lm.server` as
subprocesses on 127.0.0.1 (one at a time), stream OpenAI chat completions at them and time
the first content token.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

START_TIMEOUT_SECONDS = 300
KINDS = ("mlxformer", "mlx-lm")


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
    if kind == "mlxformer":
        return [sys.executable, "-m", "mlxformer", "serve", "--model", str(model_dir), "--port", str(port), *extra]
    return [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir), "--port", str(port),
            "--log-level", "WARNING", *extra]


class Server:
    """One server subprocess: started and healthy on enter, stopped (terminate, then kill) on exit."""

    def __init__(self, kind: str, model_dir: Path, extra: list[str] | None = None) -> None:
        self.kind, self.port = kind, free_port()
        self.command = server_command(kind, model_dir, self.port, extra or [])
        self.name = model_dir.name if kind == "mlxformer" else "default_model"  # the served model's name

    def __enter__(self) -> "Server":
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
        """One streamed greedy chat completion: ``ttft`` (s), generated ``tokens``, ``start``/``end``."""
        request = {"model": self.name, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                   "stream": True, "stream_options": {"include_usage": True}, **body}
        connection = HTTPConnection("127.0.0.1", self.port, timeout=3600)
        start = time.perf_counter()
        connection.request("POST", "/v1/chat/completions", json.dumps(request), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise SystemExit(f"{self.kind}: {response.status} {response.read()[:500]!r}")
        first, tokens, chunks = None, 0, 0
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    first = first or time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        end = time.perf_counter()
        connection.close()
        return {"ttft": (first or end) - start, "tokens": tokens or chunks, "start": start, "end": end}

    def metric(self, name: str) -> float | None:
        """One unlabelled counter or gauge from ``/metrics`` (mlxformer only; None if absent)."""
        if self.kind != "mlxformer":
            return None
        connection = HTTPConnection("127.0.0.1", self.port, timeout=60)
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        text = response.read().decode()
        connection.close()
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return None


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
