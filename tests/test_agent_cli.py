"""The real agent CLIs, from npm (installed by scripts/install_test_deps.sh under
$MLXFORMER_TEST_CACHE/agent-clis, pinned), each with its defaults and the settings of the README's
"Use with agents", in a throwaway HOME, against `mlxformer serve` on 127.0.0.1 serving a tiny
model that always answers "banana" (``word_model``) and, through `serve --force-tool`, answers a
user turn with a call of the CLI's shell tool: a tool round trip (the call, the CLI running it or
denying it, the result sent back, the final answer). Claude Code (`claude -p`, then
`claude -p --continue`, whose prompts come from the prompt cache: /metrics), Codex (`codex exec`
with a config.toml that only names the provider) and opencode (`opencode run` with an
OpenAI-compatible provider). Each exits 0 with the word as its answer, and the server answers no
request with a 4xx."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hf_reference_cache import cache_root
from word_model import WORD, write_word_model

ROOT = Path(__file__).resolve().parent.parent
MODULES = cache_root() / "agent-clis" / "node_modules"
CLAUDE = MODULES / "@anthropic-ai" / "claude-code-linux-x64" / "claude"
CODEX = MODULES / "@openai" / "codex-linux-x64" / "vendor" / "x86_64-unknown-linux-musl" / "bin" / "codex"
OPENCODE = MODULES / "opencode-linux-x64" / "bin" / "opencode"
NAME = "tiny"
# each CLI's shell tool: Claude Code's, Codex's, opencode's
SHELL_TOOLS = ("--force-tool", "Bash", "--force-tool", "exec_command", "--force-tool", "bash")
QUIET = {  # no telemetry, update checks or other traffic beyond the server
    "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_ERROR_REPORTING": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_SHARE": "1",
    "npm_config_offline": "true",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(hf_smollm_tokenizer, tmp_path_factory):
    for binary in (CLAUDE, CODEX, OPENCODE):
        assert binary.is_file(), f"{binary} is missing: run scripts/install_test_deps.sh"
    model = tmp_path_factory.mktemp("word_model")
    write_word_model(model, hf_smollm_tokenizer, context=65536)
    port, log = free_port(), tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "mlxformer", "serve", "--model", str(model), "--port", str(port),
                                    "--served-model-name", NAME, "--threads", "1", *SHELL_TOOLS], stdout=out, stderr=subprocess.STDOUT,
                                   env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while "Uvicorn running" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        yield SimpleNamespace(url=url, port=port, log=log)
    finally:
        process.terminate()
        process.wait(timeout=30)


def run(command: list[str], home: Path, cwd: Path, env: dict[str, str] | None = None) -> tuple[str, str]:
    """Run a CLI in a throwaway HOME; returns its ``(stdout, stderr)`` (asserting exit status 0)."""
    home.mkdir(parents=True, exist_ok=True)
    cwd.mkdir(parents=True, exist_ok=True)
    base = {k: os.environ[k] for k in ("PATH", "LANG", "TERM") if k in os.environ}
    done = subprocess.run(command, cwd=cwd, env={**base, "HOME": str(home), **QUIET, **(env or {})},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout, done.stderr


def no_client_errors(server) -> None:
    statuses = re.findall(r'"[A-Z]+ (\S+) HTTP/1.1" (\d{3})', server.log.read_text())
    assert statuses and not [s for s in statuses if s[1].startswith("4")], statuses


def prompt_tokens(url: str) -> dict[str, float]:
    from server_support import http

    text = http(url, "GET", "/metrics")[2].decode()
    return {source: float(value) for source, value in
            re.findall(r'^mlxformer_api_prompt_tokens_total\{api="messages",source="(\w+)"\} (\S+)$', text, re.M)}


def test_claude_code(server, tmp_path):
    env = {"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "sk-local"}
    home, work = tmp_path / "home", tmp_path / "work"
    first = json.loads(run([str(CLAUDE), "-p", "--output-format", "json", "Say the word."], home, work, env)[0])
    assert first["result"] == WORD and first["num_turns"] == 2  # the Bash call (denied: -p's default), then the word
    assert [d["tool_name"] for d in first["permission_denials"]] == ["Bash"]
    before = prompt_tokens(server.url)
    second = run([str(CLAUDE), "-p", "--continue", "Again."], home, work, env)[0]
    assert second.strip() == WORD
    after = prompt_tokens(server.url)
    cached, prefilled = after["cached"] - before["cached"], after["prefilled"] - before["prefilled"]
    assert cached > 10000 and prefilled < 0.1 * (cached + prefilled)  # turn 2: its prompts mostly from the cache
    no_client_errors(server)


def test_codex(server, tmp_path):
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    (home / ".codex" / "config.toml").write_text(
        f'model = "{NAME}"\nmodel_provider = "mlxformer"\n\n[model_providers.mlxformer]\nname = "mlxformer"\n'
        f'base_url = "{server.url}/v1"\nwire_api = "responses"\n')
    output = "\n".join(run([str(CODEX), "exec", "--skip-git-repo-check", "Say the word."], home, tmp_path / "work"))
    # the call ran (its arguments are sampled junk after "banana": Codex samples at temperature 1)
    assert re.search(r"^exec\n/bin/bash -lc .*banana.*\n exited [1-9]\d* in ", output, re.M), output[-2000:]
    assert re.search(rf"^codex\n{WORD}$", output, re.M), output[-2000:]
    no_client_errors(server)


def test_opencode(server, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"mlxformer": {"npm": "@ai-sdk/openai-compatible", "name": "mlxformer",
                                   "options": {"baseURL": f"{server.url}/v1"}, "models": {NAME: {"name": NAME}}}},
        "model": f"mlxformer/{NAME}", "autoupdate": False, "share": "disabled"}))
    answer, log = run([str(OPENCODE), "run", "Say the word."], tmp_path / "home", work)
    assert "banana" in log.split("$", 1)[-1] and answer.strip() == WORD, (answer + log)[-2000:]  # the call, then the word
    no_client_errors(server)
