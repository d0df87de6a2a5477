"""The README as a newcomer reads it: its Python example runs as written (on the default model's
real path, not a placeholder), it stays short, and every relative link in it and in the guides
it points to (docs/guide/) names a file that exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def test_the_python_example_runs_as_written():
    api = section(README.read_text(), "Python API")
    code = re.search(r"```python\n(.*?)```", api, re.S).group(1)
    assert "path/to" not in code
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = done.stdout.splitlines()[:2]
    assert "Paris" in first and second.strip()


def test_the_readme_is_short_and_its_links_resolve():
    assert len(README.read_text().splitlines()) < 400
    for page in [README, *sorted((ROOT / "docs" / "guide").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to a missing {target}"
