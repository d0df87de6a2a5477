"""`mlxformer serve` as a user runs it: a subprocess on 127.0.0.1 with --api-key, --cors-origin
and --strict-model-names, driven with the openai and anthropic clients and Ollama's curl, stopped
with Ctrl-C; bad flags, and a port another server holds, are one-line errors."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import anthropic
import openai
import pytest
from server_support import http, serve_subprocess


def test_serve_subprocess_with_key_and_cors(smollm_gguf):
    command = [
        sys.executable, "-m", "mlxformer", "serve", "--model", str(smollm_gguf),
        "--max-batch", "2", "--api-key", "k3y", "--cors-origin", "http://app.example", "--served-model-name", "smol",
        "--strict-model-names",
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
        # --strict-model-names: the agent APIs and Ollama's refuse another name (by default they serve it)
        hi = [{"role": "user", "content": "hi"}]
        claude = anthropic.Anthropic(base_url=url, api_key="k3y", max_retries=0, timeout=300)
        with pytest.raises(anthropic.NotFoundError):
            claude.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=hi)
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="gpt-5", input="hi", max_output_tokens=4)
        status, _, _ = http(url, "POST", "/api/chat", {"model": "llama3", "messages": hi},
                            headers={"Authorization": "Bearer k3y"})
        assert status == 404


def test_serve_bad_flags_are_one_line_errors():
    for flags in (["--max-batch", "0"], ["--port", "70000"], ["--api-key", " "], ["--prompt-cache-bytes", "-1"],
                  ["--sse-ping-seconds", "-1"]):
        result = subprocess.run(
            [sys.executable, "-m", "mlxformer", "serve", *flags], capture_output=True, text=True, timeout=120,
            env={**os.environ, "MLXFORMER_API_KEY": ""},
        )
        assert result.returncode == 1
        assert result.stderr.startswith("mlxformer: error:") and len(result.stderr.strip().splitlines()) == 1


def test_the_old_flag_spelling_is_a_hidden_alias():
    from mlxformer.cli.main import build_parser

    assert build_parser().parse_args(["serve", "--strict-model-name"]).strict_model_names is True
    assert "--strict-model-name " not in build_parser().format_help()


def test_serve_on_a_port_in_use_is_one_line_before_the_model_loads(smollm_gguf):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "mlxformer", "serve", "--model", str(smollm_gguf), "--port",
                                 str(port)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == (f"mlxformer: error: cannot listen on 127.0.0.1:{port}: Address already in use; another "
                             "server is using the port: pick another --port\n")
