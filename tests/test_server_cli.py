"""`mlxformer serve` as a user runs it: a subprocess on 127.0.0.1 with --api-key and
--cors-origin, driven with the openai client, stopped with Ctrl-C; bad flags are one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys

import openai
from server_support import http, serve_subprocess


def test_serve_subprocess_with_key_and_cors(smollm_gguf):
    command = [
        sys.executable, "-m", "mlxformer", "serve", "--model", str(smollm_gguf),
        "--max-batch", "2", "--api-key", "k3y", "--cors-origin", "http://app.example", "--served-model-name", "smol",
    ]
    with serve_subprocess(command) as url:
        assert http(url, "GET", "/v1/models")[0] == 401
        preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}
        status, headers, _ = http(url, "OPTIONS", "/v1/chat/completions", headers=preflight)
        assert status == 200 and headers["access-control-allow-origin"] == "http://app.example"
        client = openai.OpenAI(base_url=url + "/v1", api_key="k3y", max_retries=0, timeout=300)
        reply = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=8, temperature=0,
        )
        assert "Paris" in reply.choices[0].message.content


def test_serve_bad_flags_are_one_line_errors():
    for flags in (["--max-batch", "0"], ["--port", "70000"], ["--api-key", " "], ["--prompt-cache-bytes", "-1"],
                  ["--sse-ping-seconds", "-1"]):
        result = subprocess.run(
            [sys.executable, "-m", "mlxformer", "serve", *flags], capture_output=True, text=True, timeout=120,
            env={**os.environ, "MLXFORMER_API_KEY": ""},
        )
        assert result.returncode == 1
        assert result.stderr.startswith("mlxformer: error:") and len(result.stderr.strip().splitlines()) == 1
