"""The one checkpoint reader (issue 18): every file is checked before it is trusted, with
one-line errors naming the file and the key, before any model is built."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import gguf_helpers
from conftest import edit_config, write_tiny_checkpoint
from mlxformer.cli import main
from mlxformer.errors import MlxformerError
from mlxformer.formats.checkpoint import open_checkpoint
from mlxformer.loader import build_model, load, read_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    directory, _ = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")
    return directory


def copy_of(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def one_line_error(capsys, *argv: str) -> str:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 1 and out == "", (code, out, err)
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlxformer: error: ") and "Traceback" not in err, err
    return lines[0]


def test_layer_count_is_checked_against_the_tensors_before_building(tiny_dir, tmp_path):
    """``num_hidden_layers: 3000000`` used to build 3 million layers (60 s, 6.6 GB, then a kill); it is now
    above the bound (test_config_bounds.py), and a count within it must still be the tensors'."""
    model = copy_of(tiny_dir, tmp_path / "m")
    edit_config(model, num_hidden_layers=3_000)
    code = f"from mlxformer import load\nload({str(model)!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "3000 layers" in last and "tensors are for 2" in last and str(model) in last, last


@pytest.mark.parametrize("shard", ["../victim/model.safetensors", "/etc/model.safetensors", "sub/../../x.safetensors"])
def test_shard_index_paths_stay_in_the_model_dir(tiny_dir, tmp_path, shard):
    model = copy_of(tiny_dir, tmp_path / "m")
    victim = tmp_path / "victim"
    victim.mkdir()
    shutil.copy(model / "model.safetensors", victim / "model.safetensors")  # a loadable file outside
    with open(model / "model.safetensors", "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        names = [n for n in json.loads(f.read(length)) if n != "__metadata__"]
    weight_map = {name: "model.safetensors" for name in names}
    weight_map[names[0]] = shard
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(MlxformerError, match="points outside the model dir") as info:
        open_checkpoint(model)
    assert "model.safetensors.index.json" in str(info.value) and names[0] in str(info.value)


def write_safetensors(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("entry, complaint", [
    ({"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}, "dtype is not a string"),
    ({"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}, "data_offsets is not two integers"),
    ({"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}, "shape is not a list"),
    ({"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}, "shape is not a list"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, "not an increasing pair"),
    ({"dtype": "F8_E4M3", "shape": [8], "data_offsets": [0, 8]}, "unsupported dtype"),
    ("F32", "not an object"),
])
def test_ill_typed_safetensors_headers_are_one_line_errors(tiny_dir, tmp_path, capsys, entry, complaint):
    model = copy_of(tiny_dir, tmp_path / "m")
    write_safetensors(model / "model.safetensors", {"model.norm.weight": entry}, bytes(8))
    line = one_line_error(capsys, "info", "--model", str(model))
    assert complaint in line and "model.safetensors" in line and "model.norm.weight" in line, line


def test_overlapping_tensors_are_refused(tiny_dir, tmp_path):
    model = copy_of(tiny_dir, tmp_path / "m")
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    write_safetensors(model / "model.safetensors", header, bytes(12))
    with pytest.raises(MlxformerError, match="'b' overlaps tensor 'a'"):
        open_checkpoint(model)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
def test_integer_tensors_where_floats_belong_are_refused(tiny_dir, tmp_path, dtype):
    """``check_weights`` used to compare shapes only: an int8 norm loaded and computed garbage."""
    from safetensors.numpy import load_file, save_file

    model = copy_of(tiny_dir, tmp_path / "m")
    tensors = load_file(str(model / "model.safetensors"))
    name = "model.layers.1.input_layernorm.weight"
    tensors[name] = np.ones(tensors[name].shape, dtype=dtype)
    save_file(tensors, str(model / "model.safetensors"))
    with pytest.raises(MlxformerError, match=f"weight '{name}' has dtype {np.dtype(dtype).name}, the model "
                                             "needs a floating dtype"):
        load(model)


def test_consolidated_copy_is_not_merged_into_the_weights(tiny_dir, tmp_path):
    """Mistral repos ship ``consolidated.safetensors`` beside the HF weights; a dir without an
    index used to merge every ``*.safetensors`` (here: an unexpected-weight error)."""
    from safetensors.numpy import save_file

    model = copy_of(tiny_dir, tmp_path / "m")
    save_file({"layers.0.attention.wq.weight": np.zeros((4, 4), np.float32)}, str(model / "consolidated.safetensors"))
    checkpoint = open_checkpoint(model)
    assert "layers.0.attention.wq.weight" not in checkpoint.tensors
    build_model(*read_checkpoint(model)[:2])


def test_hub_download_fetches_what_mlx_lm_fetches():
    """The hub client's own filter over Mistral-7B-Instruct-v0.3's file list: the sharded HF
    weights and their index, not the consolidated copy (twice the download), pickles or code."""
    from huggingface_hub.utils import filter_repo_objects

    from mlxformer.formats.hub import HUB_ALLOW_PATTERNS

    files = ["config.json", "consolidated.safetensors", "generation_config.json", "model-00001-of-00003.safetensors",
             "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors", "model.safetensors.index.json",
             "params.json", "special_tokens_map.json", "tokenizer.json", "tokenizer.model", "tokenizer.model.v3",
             "tokenizer_config.json", "pytorch_model.bin", "modeling_x.py", "README.md"]
    fetched = set(filter_repo_objects(files, allow_patterns=HUB_ALLOW_PATTERNS))
    assert fetched == set(files) - {"consolidated.safetensors", "tokenizer.model.v3", "pytorch_model.bin",
                                    "modeling_x.py", "README.md"}


@pytest.mark.parametrize("length", [1, 9])
def test_rope_freqs_of_the_wrong_length_are_refused(tmp_path, monkeypatch, length):
    """A ``rope_freqs`` of length 1 used to broadcast silently, other lengths failed in MLX."""
    rope = {"rope_type": "llama3", "rope_theta": 1000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    _, hf_model = write_tiny_checkpoint(tmp_path / "hf", "llama", rope_parameters=rope, max_position_embeddings=128)
    monkeypatch.setattr(gguf_helpers, "llama3_rope_factors", lambda config: np.ones(length, np.float32))
    path = tmp_path / "bad.gguf"
    gguf_helpers.write_gguf_from_hf(path, hf_model, "llama", lambda name, shape: T.F32)
    with pytest.raises(MlxformerError, match=f"rope_freqs.weight has {length} factors, the head dim 16 needs 8") as info:
        open_checkpoint(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("changes, complaint", [
    ({"rms_norm_eps": "tiny"}, "rms_norm_eps must be a positive number"),
    ({"hidden_size": "64"}, "hidden_size is not a positive integer"),
    ({"quantization": {"group_size": 64, "bits": "4"}}, "group_size/bits are not positive integers"),
    ({"quantization": {"group_size": 64, "bits": 4, "model.layers.0.mlp.up_proj": 4}}, "'model.layers.0.mlp.up_proj'"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization method 'gptq'"),
    ({"quantization": {"group_size": 64, "bits": 4, "mode": "int3"}}, "quantization mode 'int3' is not supported"),
    ({"quantization": {"group_size": 64, "bits": 4, "lm_head": {"group_size": 32, "bits": 8, "mode": "fp3"}}},
     "quantization mode 'fp3' is not supported"),
])
def test_ill_typed_config_values_are_one_line_errors(tiny_dir, tmp_path, capsys, changes, complaint):
    model = copy_of(tiny_dir, tmp_path / "m")
    edit_config(model, **changes)
    line = one_line_error(capsys, "info", "--model", str(model))
    assert complaint in line and "config" in line, line
