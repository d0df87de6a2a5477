"""``convert --force`` replaces only an empty dir or a model dir, never a dir that holds the
current directory, the source, the home dir or ``/`` (issue 9, defect 6). Through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import write_tiny_checkpoint
from mlxformer.cli import main as cli_main


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory) -> Path:
    directory, _ = write_tiny_checkpoint(tmp_path_factory.mktemp("dest_src") / "tiny", "llama", seed=1)
    return directory


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (``None`` for a dir)."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


def convert_cli(capsys, source: Path, destination: str) -> tuple[int, list[str]]:
    code = cli_main(["convert", "--hf-path", str(source), "--mlx-path", destination, "--force"])
    return code, capsys.readouterr().err.strip().splitlines()


def test_force_replaces_nothing_but_empty_and_model_dirs(tiny_source, tmp_path, capsys, monkeypatch):
    # the source sits inside the work tree here, so "parent of the source" is a real dir to protect
    work = tmp_path / "work"
    source = work / "models" / "tiny"
    source.mkdir(parents=True)
    for f in tiny_source.iterdir():
        (source / f.name).write_bytes(f.read_bytes())
    (work / "notes.txt").write_text("my notes")
    (work / "project").mkdir()
    (work / "project" / "main.py").write_text("print('hi')")
    (work / "project" / "config.json").write_text("{}")  # looks like a model dir at first glance...
    (work / "project" / "model.safetensors").write_bytes(b"x")
    (work / "project" / "src").mkdir()  # ...but has a subdirectory
    (work / "a_file").write_text("just a file")
    home = tmp_path / "home"
    (home / "docs").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    before = snapshot(tmp_path)

    cases = {
        ".": "current directory",
        str(work): "current directory",
        str(tmp_path): "current directory",
        "models": "source",  # the parent of the source
        "models/tiny": "source",  # the source itself
        "~": "home",
        "project": "not a model dir",
        "a_file": "not a model dir",
    }
    for destination, reason in cases.items():
        code, err = convert_cli(capsys, source, destination)
        assert code == 1 and len(err) == 1 and err[0].startswith("mlxformer: error: "), (destination, err)
        assert reason in err[0], (destination, err)
        assert snapshot(tmp_path) == before, destination  # nothing moved, written or deleted


def test_force_refuses_the_root(tiny_source, capsys):
    code, err = convert_cli(capsys, tiny_source, "/")
    assert code == 1 and len(err) == 1 and "filesystem root" in err[0], err


def test_force_replaces_an_empty_dir_and_a_previous_output(tiny_source, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert convert_cli(capsys, tiny_source, str(empty))[0] == 0
    assert (empty / "config.json").is_file() and (empty / "model.safetensors").is_file()

    (empty / "stale.txt").write_text("left over")  # a model dir with an extra file is still a model dir
    config = json.loads((empty / "config.json").read_text())
    assert convert_cli(capsys, tiny_source, str(empty))[0] == 0
    assert not (empty / "stale.txt").exists() and json.loads((empty / "config.json").read_text()) == config
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # no temp or old dirs left
