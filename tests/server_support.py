"""Helpers for the server tests: the real model loaded for a background engine, a server on a
free 127.0.0.1 port that always stops, and raw HTTP requests (for what the openai client hides)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from http.client import HTTPConnection
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator
from urllib.parse import urlsplit

MODEL_NAME = "smollm2-test"


def load_for_engine(path: Path) -> tuple[Any, Any]:
    """SmolLM2 on one CPU stream: the references are single-stream `generate` runs, and one
    stream costs least on a shared machine."""
    from mlxformer import load

    return load(path, threads=1)


@contextlib.contextmanager
def running_engine(model: Any, tokenizer: Any, **engine_args: Any) -> Iterator[Any]:
    """A started engine, stopped at the end."""
    from mlxformer.engine import Engine

    engine = Engine(model, tokenizer, **engine_args)
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


@contextlib.contextmanager
def running_server(engine: Any, model: Any, tokenizer: Any, **app_args: Any) -> Iterator[str]:
    """The API app over ``engine`` on a free 127.0.0.1 port; yields its base URL."""
    from mlxformer.server.app import create_app
    from mlxformer.server.runner import ServerThread
    from mlxformer.server.translate import ServedModel

    served = ServedModel.of(MODEL_NAME, model, tokenizer)
    with ServerThread(create_app(engine, served, **app_args)) as server:
        yield server.url


@contextlib.contextmanager
def served(model: Any, tokenizer: Any, **engine_args: Any) -> Iterator[SimpleNamespace]:
    """An engine over ``model`` and the API app over it: ``url``, ``engine``, ``model``, ``tokenizer``."""
    with running_engine(model, tokenizer, **engine_args) as engine:
        with running_server(engine, model, tokenizer) as url:
            yield SimpleNamespace(url=url, engine=engine, model=model, tokenizer=tokenizer)


def http(
    url: str, method: str, path: str, body: bytes | dict | None = None, headers: dict[str, str] | None = None,
    timeout: float = 120.0,
) -> tuple[int, dict[str, str], bytes]:
    """One raw HTTP request: ``(status, lower-cased headers, body)``."""
    parts = urlsplit(url)
    connection = HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    headers = dict(headers or {})
    if isinstance(body, dict):
        body = json.dumps(body).encode()
        headers.setdefault("Content-Type", "application/json")
    try:
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def error_of(body: bytes) -> dict[str, Any]:
    """The ``error`` object of an OpenAI-style error body (asserting its shape)."""
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    return error


SERVE_START_TIMEOUT_SECONDS = 180


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve_subprocess(command: list[str]) -> Iterator[str]:
    """``command`` (an ``mlxformer serve`` invocation) on a free port; yields the base URL once
    ``/health`` answers; at the end SIGINT, and the server must exit 0 within 30 s."""
    with serving_process(command) as (url, _):
        yield url


@contextlib.contextmanager
def serving_process(command: list[str]) -> Iterator[tuple[str, subprocess.Popen]]:
    """``serve_subprocess`` yielding ``(base URL, the server's process)``."""
    port = free_port()
    process = subprocess.Popen([*command, "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVE_START_TIMEOUT_SECONDS
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if http(url, "GET", "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.3)
        yield url, process
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    assert process.returncode == 0


# Debian's package (scripts/install_test_deps.sh installs it); elsewhere point MLXFORMER_CHROMIUM at a Chromium.
CHROMIUM = os.environ.get("MLXFORMER_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]


@contextlib.contextmanager
def browser_page(profile: Path) -> Iterator[Any]:
    """A page of headless Chromium driven by Playwright (profile in ``profile``), closed at the end."""
    import shutil

    from playwright.sync_api import sync_playwright

    assert shutil.which(CHROMIUM), "chromium is not installed: run scripts/install_test_deps.sh"
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
        )
        try:
            yield context.new_page()
        finally:
            context.close()
