"""Bad input gives a one-line ``mlxformer: error: ...`` on stderr and exit code 1, without a
traceback unless ``--verbose`` is given."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import edit_config, write_tiny_checkpoint
from mlxformer.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def generate_args(model: Path | str, prompt: str = "Hello") -> list[str]:
    return ["generate", "--model", str(model), "--prompt", prompt, "--max-tokens", "1"]


def assert_one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 1
    assert out == ""
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("mlxformer: error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    directory, _ = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")
    return directory


def copy_of(tiny_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    target.mkdir()
    for file in tiny_dir.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target


@pytest.fixture(scope="module")
def gguf_prefixes(smollm_gguf, tmp_path_factory) -> dict[str, Path]:
    """The real GGUF cut inside its header (300 B) and inside its tensor data (2 MB)."""
    directory = tmp_path_factory.mktemp("gguf")
    with open(smollm_gguf, "rb") as f:
        head = f.read(2_000_000)
    paths = {"header": directory / "header.gguf", "data": directory / "data.gguf"}
    paths["header"].write_bytes(head[:300])
    paths["data"].write_bytes(head)
    return paths


def test_missing_path(capsys, tmp_path):
    missing = tmp_path / "no-such-model"
    assert_one_line_error(*run_cli(capsys, *generate_args(missing)), str(missing), "no such file")


def test_dir_without_config(capsys, tiny_dir, tmp_path):
    directory = copy_of(tiny_dir, tmp_path)
    (directory / "config.json").unlink()
    assert_one_line_error(*run_cli(capsys, *generate_args(directory)), "config.json")


def test_unknown_model_type(capsys, tiny_dir, tmp_path):
    directory = copy_of(tiny_dir, tmp_path)
    edit_config(directory, model_type="gpt_neox")
    assert_one_line_error(*run_cli(capsys, *generate_args(directory)), "gpt_neox")


def test_truncated_safetensors(capsys, tiny_dir, tmp_path):
    directory = copy_of(tiny_dir, tmp_path)
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    assert_one_line_error(*run_cli(capsys, *generate_args(directory)), "model.safetensors", "truncated")


def test_tensor_shape_mismatch(capsys, tiny_dir, tmp_path):
    directory = copy_of(tiny_dir, tmp_path)
    edit_config(directory, intermediate_size=96)  # the checkpoint's MLP is 128 wide
    code, out, err = run_cli(capsys, *generate_args(directory))
    assert_one_line_error(code, out, err, "mlp.", "128", "96")


def test_zero_threads(capsys, tiny_dir):
    assert_one_line_error(*run_cli(capsys, *generate_args(tiny_dir), "--threads", "0"), "--threads")


def test_not_a_gguf_file(capsys, tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("this is not a GGUF file\n")
    assert_one_line_error(*run_cli(capsys, *generate_args(fake)), str(fake), "not a GGUF")


@pytest.mark.parametrize("where", ["header", "data"])
def test_truncated_gguf(capsys, gguf_prefixes, where):
    path = gguf_prefixes[where]
    needle = "truncated" if where == "header" else "extends past the end"
    assert_one_line_error(*run_cli(capsys, *generate_args(path)), str(path), needle)


@pytest.mark.parametrize("prompt", ["", "   \n\t"])
def test_empty_prompt(capsys, smollm_gguf, prompt):
    assert_one_line_error(*run_cli(capsys, *generate_args(smollm_gguf, prompt)), "empty prompt")


def _console(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(["mlxformer", *argv], capture_output=True, text=True, env=env, timeout=120)


def test_console_script_one_line_error(tmp_path):
    missing = tmp_path / "nothing-here"
    proc = _console(*generate_args(missing))
    assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, str(missing))


@pytest.mark.parametrize("flag_first", [True, False], ids=["main-flag", "subcommand-flag"])
def test_verbose_shows_traceback(capsys, tmp_path, flag_first):
    missing = tmp_path / "nothing-here"
    argv = ["--verbose", *generate_args(missing)] if flag_first else [*generate_args(missing), "--verbose"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 1 and out == ""
    assert "Traceback (most recent call last)" in err and "MlxformerError" in err
    assert err.strip().splitlines()[-1].startswith("mlxformer: error: ")


def test_verbose_console_script(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("not gguf")
    proc = _console("--verbose", *generate_args(fake))
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr and "not a GGUF" in proc.stderr
