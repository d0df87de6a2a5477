"""Unloading a model returns its memory, measured on ``mlxformer serve`` subprocesses as a user
runs them (the test process's own RSS says nothing: its heap holds whatever earlier tests freed).

A two-model server loads a tiny random Llama and then the real SmolLM2 GGUF; SmolLM2's
``keep_alive`` runs out and the idle reaper unloads it. Its RSS must come back within 10% of a
one-model server's (``serve --model TINY``, after the same request), and ``/metrics`` must show
SmolLM2's weights and MLX's allocation gone. What returns the memory (``hosts.MultiHost._unload``),
each step measured here by leaving it out (SmolLM2 unloaded, tiny model kept; one-model server
140 MB, all steps 142 MB): FastAPI's cached route callables (holding the app's engine) 258 MB,
``gc.collect`` (the engine's reference cycles) 258 MB, ``mx.clear_cache`` 177 MB,
``malloc_trim`` 204 MB.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import psutil
from server_support import http, serving_process

SETTLE_SECONDS = 10


def chat(url: str, model: str, keep_alive: object) -> None:
    status, _, body = http(url, "POST", "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4, "temperature": 0,
        "keep_alive": keep_alive})
    assert status == 200, body


def settled_rss(process) -> int:
    """The server's RSS once it stops moving (two readings 0.5 s apart within 1 MB; at most
    ``SETTLE_SECONDS``): an unload frees in the background."""
    proc = psutil.Process(process.pid)
    last, deadline = proc.memory_info().rss, time.monotonic() + SETTLE_SECONDS
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = proc.memory_info().rss
        if abs(now - last) < 2**20:
            return now
        last = now
    return last


def metrics(url: str) -> dict[str, float]:
    status, _, body = http(url, "GET", "/metrics")
    assert status == 200
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(mlxformer_\S+) (\S+)$", body.decode(), re.M)}


def state(url: str, name: str) -> str:
    return {m["id"]: m["state"] for m in json.loads(http(url, "GET", "/v1/models")[2])["data"]}[name]


def test_idle_unload_returns_rss_to_the_one_model_servers(smollm_gguf, tiny_smol):
    tiny, smol = str(tiny_smol[0]), str(smollm_gguf)
    tiny_name, smol_name = Path(tiny).resolve().name, Path(smol).stem
    serve = [sys.executable, "-m", "mlxformer", "serve", "--max-batch", "2"]
    with serving_process([*serve, "--model", tiny]) as (url, process):
        chat(url, tiny_name, -1)
        one = settled_rss(process)
    with serving_process([*serve, "--model", tiny, "--model", smol, "--max-loaded-models", "2"]) as (url, process):
        chat(url, tiny_name, -1)  # kept loaded
        chat(url, smol_name, "6s")  # unloaded once idle for 6 s
        both, loaded = psutil.Process(process.pid).memory_info().rss, metrics(url)
        assert state(url, smol_name) == "loaded"
        deadline = time.monotonic() + 120
        while state(url, smol_name) == "loaded" and time.monotonic() < deadline:
            time.sleep(0.25)
        assert state(url, smol_name) == "on disk" and state(url, tiny_name) == "loaded"
        after = settled_rss(process)
        unloaded = metrics(url)
    print(f"\nRSS: one-model server {one / 1e6:.0f} MB; two models {both / 1e6:.0f} MB; "
          f"after SmolLM2's idle unload {after / 1e6:.0f} MB ({after / one - 1:+.1%}); MLX active "
          f"{loaded['mlxformer_mlx_active_bytes'] / 1e6:.0f} -> {unloaded['mlxformer_mlx_active_bytes'] / 1e6:.0f} MB")
    smol_weights = loaded[f'mlxformer_model_weight_bytes{{model="{smol_name}"}}']
    assert both - one > 0.5 * smol_weights  # loading SmolLM2 shows in the RSS: the measure can see an unload fail
    assert after <= 1.1 * one
    assert loaded[f'mlxformer_model_loaded{{model="{smol_name}"}}'] == 1
    assert unloaded[f'mlxformer_model_loaded{{model="{smol_name}"}}'] == 0
    assert unloaded[f'mlxformer_model_weight_bytes{{model="{smol_name}"}}'] == 0
    tiny_weights = f'mlxformer_model_weight_bytes{{model="{tiny_name}"}}'
    assert unloaded[tiny_weights] == loaded[tiny_weights] > 0
    assert loaded["mlxformer_mlx_active_bytes"] - unloaded["mlxformer_mlx_active_bytes"] >= smol_weights
    assert unloaded["mlxformer_mlx_cache_bytes"] == 0
