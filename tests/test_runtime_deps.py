"""Every third-party module the library imports at run time belongs to a distribution that
pyproject's ``dependencies`` (not an extra) pull in: a statically found import, and in a fresh
interpreter where the distributions outside that closure cannot be imported, every module of the
package imports and the server app is built and answers a chat completion."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mlxformer"
# imported only by the commands that need them, each of which says so when it is missing
OPTIONAL = {"matplotlib", "psutil"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_closure() -> set[str]:
    """The distributions (canonical names) that ``pip install .`` installs: the dependencies,
    with markers evaluated here and no extras, and theirs, recursively."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["dependencies"]]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        extras = req.extras
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonical(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in ("", *extras)):
                todo.append(sub)
    return seen


def module_owners() -> dict[str, set[str]]:
    """Top-level module name -> the installed distributions (canonical) that provide it."""
    return {top: {canonical(d) for d in dists} for top, dists in metadata.packages_distributions().items()}


def third_party_imports() -> dict[str, set[str]]:
    """Top-level modules imported anywhere in the package (not under ``TYPE_CHECKING``) that are
    neither the standard library nor the package itself -> the files importing them."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = []
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top != "mlxformer" and top not in sys.stdlib_module_names:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_import_is_a_runtime_dependency():
    closure, owners = runtime_closure(), module_owners()
    assert "regex" in third_party_imports()  # the scan sees the tool-call parsers' import
    missing = {top: sorted(files)[:3] for top, files in third_party_imports().items()
               if top not in OPTIONAL and not owners.get(top, set()) & closure}
    assert not missing, f"imported but not in pyproject's dependencies: {missing}"


BLOCKER = """
import importlib.abc, json, sys
blocked = set(json.loads(sys.argv[1]))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (not a runtime dependency)", name=name)
        return None
sys.meta_path.insert(0, Block())
"""

SERVE = """
import importlib, pkgutil, sys, mlxformer
for info in pkgutil.walk_packages(mlxformer.__path__, "mlxformer."):
    if not info.name.startswith("mlxformer.cli.") and info.name not in ("mlxformer.tools.bench", "mlxformer.__main__"):
        importlib.import_module(info.name)
import mlxformer.cli.serve, mlxformer.cli.main
from pathlib import Path
from fastapi.testclient import TestClient
from mlxformer import load
from mlxformer.engine import Engine
from mlxformer.server.app import create_app
from mlxformer.server.translate import ServedModel
model, tokenizer = load(Path(sys.argv[2]), threads=1)
engine = Engine(model, tokenizer, max_batch=1)
engine.start()
try:
    app = create_app(engine, ServedModel.of("tiny", model, tokenizer))
    reply = TestClient(app, base_url="http://127.0.0.1").post("/v1/chat/completions", json={
        "model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 200, reply.text
    print("served", reply.json()["usage"]["completion_tokens"])
finally:
    engine.stop()
"""


def test_package_runs_with_runtime_dependencies_only(tmp_path):
    from agent_support import tiny_chat_model

    closure, owners = runtime_closure(), module_owners()
    # what the test extra brings beyond the runtime closure (starlette's TestClient needs httpx)
    blocked = sorted(top for top, dists in owners.items()
                     if not dists & closure and top not in ("mlxformer", "httpx", "httpcore", "_pytest", "pytest", "h11", "anyio",
                                                            "sniffio", "certifi", "idna") and top.isidentifier())
    assert "regex" in blocked or "regex" in {t for t, d in owners.items() if d & closure}
    assert "transformers" in blocked and "torch" in blocked
    tiny_chat_model(tmp_path, "{% for m in messages %}{{ m.content }}{% endfor %}")
    script = BLOCKER + SERVE
    run = subprocess.run([sys.executable, "-c", script, json.dumps(blocked), str(tmp_path)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().startswith("served")


def test_a_clean_venv_with_the_demo_install_serves(tmp_path, hf_smollm_tokenizer):
    """The README's demo install (``pip install -e .``, no extras) into a new virtual environment
    (nothing of this one's site-packages), then ``mlxformer serve`` answers a chat completion."""
    import os
    import shutil
    import socket
    import time
    import urllib.request
    import venv

    from word_model import WORD, write_word_model

    model = tmp_path / "word"
    write_word_model(model, hf_smollm_tokenizer, context=2048)
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    bin_dir = env_dir / "bin"
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    clean["PATH"] = f"{bin_dir}{os.pathsep}{clean.get('PATH', '')}"
    # a copy of the source (an editable install into the tree would leave build files in it)
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "tests", "benchmarks", "docs", "*.egg-info",
                                                                "__pycache__", "build"))
    install = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "-e", str(source)],
                             capture_output=True, text=True, timeout=900, env=clean, cwd=tmp_path)
    assert install.returncode == 0, install.stderr[-3000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen([str(bin_dir / "mlxformer"), "serve", "--model", str(model), "--port", str(port),
                                   "--threads", "1"], stdout=out, stderr=subprocess.STDOUT, env=clean, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while "Uvicorn running" not in log.read_text():
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        body = json.dumps({"model": "word", "max_tokens": 8, "temperature": 0,
                           "messages": [{"role": "user", "content": "hi"}]}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            answer = json.loads(reply.read())
        assert answer["choices"][0]["message"]["content"].strip() == WORD, answer
    finally:
        server.terminate()
        server.wait(timeout=30)
