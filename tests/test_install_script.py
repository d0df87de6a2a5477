"""``scripts/install_test_deps.sh`` (the README's test set-up, run by ``.ci/run``) says what each
step does as it starts, above all before the quiet ~10-minute llama.cpp build: the script runs
on a fresh cache with stand-ins for pip, python, npm and chromium on PATH that only report their
calls (and ``pip download`` leaves an sdist-shaped tarball), so the order of its messages and
of the real commands it would run is seen."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPORT = '#!/bin/sh\necho "CALL $(basename "$0") $*" >&2\n'
PIP = REPORT + '''if [ "$1" = download ]; then
  while [ "$#" -gt 0 ]; do if [ "$1" = -d ]; then dir="$2"; fi; shift; done
  version=$(grep -m1 '^LLAMA_CPP_PYTHON_VERSION=' "$SCRIPT" | cut -d= -f2)
  mkdir -p "$dir/llama_cpp_python-$version"
  tar -czf "$dir/llama_cpp_python-$version.tar.gz" -C "$dir" "llama_cpp_python-$version"
  rm -r "$dir/llama_cpp_python-$version"
fi
'''


def test_each_step_is_announced_before_it_runs(tmp_path):
    script = ROOT / "scripts" / "install_test_deps.sh"
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in {"pip": PIP, "npm": REPORT, "chromium": REPORT, "python": REPORT + "exit 1\n"}.items():
        (stubs / name).write_text(body)
        (stubs / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "SCRIPT": str(script),
           "MLXFORMER_TEST_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    said = [line.split(": ", 1)[1] for line in lines if line.startswith("install_test_deps: ")]
    assert [s.split()[0] for s in said] == ["installing", "installing", "downloading", "building", "installing",
                                            "done"]

    def first(prefix: str) -> int:
        return next(i for i, line in enumerate(lines) if line.startswith(prefix))

    build = first("CALL pip install -q --no-cache-dir ")
    assert lines[build].endswith(".tar.gz") and first("install_test_deps: building llama.cpp") == build - 1
    assert first("install_test_deps: installing torch") < first("CALL pip install -q torch")
    assert first("install_test_deps: installing the agent CLIs") < first("CALL npm install")
