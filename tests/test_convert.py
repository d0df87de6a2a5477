"""``mlxformer convert``: round trips with mlx-lm and GGUF, quality of the quantization recipes
on the real SmolLM2, streaming/sharding memory, and refusals.

References are independent: mlx-lm (loading our output, converting for us), the GGUF loaded
directly, and transformers' float32 forward for perplexity (see ``TorchLogits`` in
scripts/measure_recipes.py: MLX's CPU matmul uses reference BLAS here and is ~30x slower).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from conftest import edit_config, write_byte_tokenizer, write_tiny_checkpoint
from mlxformer import convert, load
from mlxformer.cli import main as cli_main
from mlxformer.tools.perplexity import perplexity

REPO = Path(__file__).resolve().parents[1]
EVAL_TEXT = REPO / "tests/data/eval.txt"
TOKENS = mx.array([[1, 17, 42, 99, 3, 250, 7, 64]])


def _measure_module():
    spec = importlib.util.spec_from_file_location("measure_recipes", REPO / "scripts/measure_recipes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _logits(model) -> np.ndarray:
    model.set_dtype(mx.float32)
    return np.array(model(TOKENS).astype(mx.float32))


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory, smollm_hf_dir) -> Path:
    """A tiny random llama saved by transformers, with SmolLM2's tokenizer files (for mlx-lm).
    Its rope base is not the default 10000, and transformers 5 writes it only inside
    ``rope_parameters``: a reader that misses that key gives different logits."""
    directory, _ = write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_hf"), "llama", seed=3, vocab_size=256, rope_theta=100000.0
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((smollm_hf_dir / name).read_bytes())
    return directory


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("kwargs", [{"dtype": "float16"}, {"quantize": True}, {"quantize": True, "q_bits": 3,
                                    "quant_recipe": "mixed_6"}])
def test_our_output_loads_in_mlx_lm_with_the_same_logits(tiny_hf, tmp_path, kwargs):
    import mlx_lm

    out = convert(tiny_hf, tmp_path / "out", progress=False, **kwargs)
    config = json.loads((out / "config.json").read_text())
    if kwargs.get("quantize"):
        assert config["quantization"] == config["quantization_config"]
        assert config["quantization"]["bits"] == kwargs.get("q_bits", 4)
    else:
        assert "quantization" not in config
    theirs, _ = mlx_lm.load(str(out))
    ours, _ = load(out)
    np.testing.assert_allclose(_logits(ours), _logits(theirs), atol=2e-4, rtol=1e-4)
    with open(out / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["__metadata__"] == {"format": "mlx"}
    assert (out / "tokenizer.json").exists() and (out / "README.md").exists()


def test_mlx_lm_conversion_loads_in_mlxformer(tiny_hf, tmp_path):
    import mlx_lm

    # mlx-lm 0.32 reads only the classic top-level rope_theta, not transformers 5's
    # rope_parameters: give its converter a source it reads correctly.
    source = tmp_path / "classic"
    shutil.copytree(tiny_hf, source)
    config = json.loads((source / "config.json").read_text())
    edit_config(source, rope_theta=config["rope_parameters"]["rope_theta"])
    out = tmp_path / "mlx_lm_q"
    mlx_lm.convert(str(source), str(out), quantize=True)
    theirs, _ = mlx_lm.load(str(out))
    ours, _ = load(out)
    np.testing.assert_allclose(_logits(ours), _logits(theirs), atol=2e-4, rtol=1e-4)


def test_gguf_converts_exactly_and_dequantizes(smollm_gguf, tmp_path):
    direct, _ = load(smollm_gguf, dtype=mx.float32)
    expected = _logits(direct)
    out = convert(smollm_gguf, tmp_path / "gguf_mlx", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["group_size"] == 32 and config["quantization"]["bits"] == 4
    assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}  # Q8_0 token_embd
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()
    converted, tokenizer = load(out, dtype=mx.float32)
    np.testing.assert_array_equal(_logits(converted), expected)  # packed values kept as they are
    assert tokenizer.encode("The capital of France") == load(smollm_gguf)[1].encode("The capital of France")
    assert set(tokenizer.eos_token_ids) == _gguf_end_ids(smollm_gguf) == {2}  # SmolLM2 declares only eos

    floats = convert(out, tmp_path / "dequantized", dequantize=True, dtype="float32", progress=False)
    assert "quantization" not in json.loads((floats / "config.json").read_text())
    np.testing.assert_allclose(_logits(load(floats)[0]), expected, atol=1e-3, rtol=1e-3)


def _gguf_end_ids(path: Path) -> set[int]:
    """The end-of-generation ids a GGUF declares (eos, eot, eom), read with gguf-py."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return {int(reader.fields[k].contents()) for k in keys if k in reader.fields}


def test_gguf_end_of_turn_ids_survive_conversion(tmp_path):
    """A GGUF with eot and eom ids (llama 3.x style) converts to a generation_config.json whose
    eos_token_id list mlxformer, mlx-lm and transformers all read back as the GGUF's end ids."""
    import gguf
    from gguf_helpers import write_gguf_from_hf
    from mlx_lm import load as mlx_lm_load
    from transformers import GenerationConfig

    _, hf_model = write_tiny_checkpoint(tmp_path / "hf", "llama")

    def end_of_turn(writer: gguf.GGUFWriter) -> None:
        writer.add_eot_token_id(200)
        writer.add_eom_token_id(201)

    source = tmp_path / "tiny.gguf"
    write_gguf_from_hf(source, hf_model, "llama", lambda name, shape: gguf.GGMLQuantizationType.F32, end_of_turn)
    expected = _gguf_end_ids(source)
    assert expected == {1, 200, 201}
    assert set(load(source)[1].eos_token_ids) == expected
    out = convert(source, tmp_path / "converted", progress=False)
    assert set(load(out)[1].eos_token_ids) == expected
    assert set(mlx_lm_load(str(out))[1].eos_token_ids) == expected
    assert set(GenerationConfig.from_pretrained(str(out)).eos_token_id) == expected


# ---------------------------------------------------------------------------- quality (real model)


@pytest.fixture(scope="module")
def quality(smollm_hf_dir, tmp_path_factory):
    """Perplexities of the float source and of 8-bit, default -q and mlx-lm default -q outputs.

    Float source: conftest's ``smollm_hf_dir`` (GGUF dequantized by transformers, bfloat16).
    Context 256, stride 256 (3 windows over the eval text) to fit the suite's time budget.
    """
    import mlx_lm

    measure = _measure_module()
    from mlxformer.text.tokenizer import load_tokenizer_from_dir

    work = tmp_path_factory.mktemp("quality")
    ids = load_tokenizer_from_dir(smollm_hf_dir).encode(EVAL_TEXT.read_text(encoding="utf-8"))
    assert len(ids) >= 256
    float_state = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(smollm_hf_dir / "model.safetensors")).items()}
    evaluator = measure.TorchLogits(smollm_hf_dir, float_state)

    def ppl(state) -> float:
        evaluator.load(state)  # strict: every weight of the model replaced, no key left over
        return perplexity(evaluator, ids, context=256, stride=256)

    dirs = {
        "8bit": convert(smollm_hf_dir, work / "q8", quantize=True, q_bits=8, quant_recipe="rtn", progress=False),
        "default": convert(smollm_hf_dir, work / "q", quantize=True, progress=False),
    }
    mlx_lm.convert(str(smollm_hf_dir), str(work / "mlx_lm_q"), quantize=True)
    dirs["mlx_lm"] = work / "mlx_lm_q"
    result = {"float": ppl(float_state)}
    result.update({name: ppl(measure.dequantized_state(d)) for name, d in dirs.items()})
    result["default_bpw"] = measure.matrix_bits_per_weight(dirs["default"])
    result["default_dir"] = dirs["default"]
    return result


def test_8bit_is_within_half_a_percent_of_float(quality):
    assert quality["8bit"] / quality["float"] - 1 < 0.005, quality


def test_default_q_halves_mlx_lm_perplexity_increase_within_budget(quality):
    assert quality["default_bpw"] <= 4.6
    ours, theirs = quality["default"] - quality["float"], quality["mlx_lm"] - quality["float"]
    assert theirs > 0
    assert ours <= theirs / 2, quality


def test_default_q_still_answers_paris(quality):
    from mlxformer import generate

    model, tokenizer = load(quality["default_dir"])  # float32 compute on CPU (loader policy)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in generate(model, tokenizer, prompt, max_tokens=12)


# ---------------------------------------------------------------------------- streaming and sharding

# Peak RSS: VmHWM, the high-water mark of this process's own memory map. (ru_maxrss would not
# do: Linux carries the parent's peak over fork+exec, so a child of a big pytest process
# reports at least the parent's peak.) macOS has no /proc: ru_maxrss, in bytes there.
SHARD_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import mlx.core as mx

    def peak_rss():
        try:
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
        except OSError:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    from mlxformer.tools.converter import convert
    from mlxformer.formats.checkpoint import open_checkpoint
    from mlxformer.loader import load_tokenizer
    load_tokenizer(open_checkpoint(sys.argv[1]))  # the baseline holds what conversion imports and loads too
    if sys.argv[3] != "baseline":
        convert(sys.argv[1], sys.argv[2], quantize=sys.argv[3] == "mixed", max_shard_size=int(sys.argv[4]),
                progress=False)
    print(json.dumps({"peak_rss": peak_rss()}))
""")


def _write_synthetic_sharded(directory: Path, n_shards: int = 4, layers_per_shard: int = 1, hidden: int = 1024,
                             inter: int = 5632) -> int:
    """A tiny-vocab llama with big layers (float16), saved as ``n_shards`` safetensors shards of
    ``layers_per_shard`` layers + index, with a byte-level tokenizer; returns the largest shard's size."""
    from safetensors.numpy import save_file

    layers = n_shards * layers_per_shard
    config = {"model_type": "llama", "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
              "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 256, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": True, "torch_dtype": "float16"}
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    write_byte_tokenizer(directory)
    rng = np.random.default_rng(0)
    weight_map = {}
    for shard in range(n_shards):
        tensors = {}
        for i in range(shard * layers_per_shard, (shard + 1) * layers_per_shard):
            p = f"model.layers.{i}."
            tensors[p + "input_layernorm.weight"] = np.ones(hidden)
            tensors[p + "post_attention_layernorm.weight"] = np.ones(hidden)
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                tensors[p + f"self_attn.{name}.weight"] = rng.standard_normal((hidden, hidden)) / hidden**0.5
            for name, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                ("down_proj", (hidden, inter))):
                tensors[p + f"mlp.{name}.weight"] = rng.standard_normal(shape) / shape[1] ** 0.5
        if shard == 0:
            tensors["model.embed_tokens.weight"] = rng.standard_normal((256, hidden))
            tensors["model.norm.weight"] = np.ones(hidden)
        name = f"model-{shard + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file({k: v.astype(np.float16) for k, v in tensors.items()}, str(directory / name))
        weight_map.update({k: name for k in tensors})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return max(f.stat().st_size for f in directory.glob("*.safetensors"))


def _conversion_rss(source: Path, out: Path, mode: str, limit: int) -> int:
    """Peak RSS in bytes of a fresh process converting ``source`` (``mode``: float, mixed or baseline)."""
    proc = subprocess.run([sys.executable, "-c", SHARD_SCRIPT, str(source), str(out), mode, str(limit)],
                          capture_output=True, text=True, check=True, cwd=out.parent)
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss"]


def test_sharded_conversion_streams_with_bounded_memory(tmp_path):
    source = tmp_path / "sharded"
    largest = _write_synthetic_sharded(source)  # 4 shards of ~42 MB
    out, limit = tmp_path / "out", 25 * 1024**2
    baseline = _conversion_rss(source, out, "baseline", limit)  # a process that only imports and loads the tokenizer
    peak = _conversion_rss(source, out, "float", limit)
    # Peak RSS of the conversion minus the import-only baseline stays under 2x the largest input shard
    # (the model is ~170 MB, so loading it whole would exceed this).
    assert peak - baseline < 2 * largest, (peak - baseline, largest)

    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(out.glob("*.safetensors"))
    assert len(files) >= 6 and set(index["weight_map"].values()) == {f.name for f in files}
    assert all(f.stat().st_size <= limit + 4096 for f in files)
    loaded = {}
    for f in files:
        loaded.update(mx.load(str(f)))
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in loaded.values())
    source_tensors = {}
    for f in source.glob("*.safetensors"):
        source_tensors.update(mx.load(str(f)))
    assert set(loaded) == set(source_tensors)
    name = "model.layers.2.mlp.down_proj.weight"
    assert mx.array_equal(loaded[name], source_tensors[name])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]


def test_gguf_conversion_streams_with_bounded_memory(tmp_path, smollm_gguf):
    """GGUF -> MLX decodes one tensor at a time (it used to decode the whole model first): the
    real SmolLM2 Q4_1 (98 MB of weights) converts in 16 MB shards (its 30 MB Q8_0 embedding
    gets one of its own) within 2x the largest."""
    out, limit = tmp_path / "out", 16 * 1024**2
    baseline = _conversion_rss(smollm_gguf, out, "baseline", limit)  # imports, header and vocabulary
    peak = _conversion_rss(smollm_gguf, out, "float", limit)
    files = sorted(out.glob("*.safetensors"))
    largest = max(f.stat().st_size for f in files)
    print(f"\nGGUF convert: peak RSS above baseline {(peak - baseline) / 2**20:.0f} MiB, largest output shard "
          f"{largest / 2**20:.0f} MiB, {len(files)} shards")
    assert len(files) >= 5
    assert peak - baseline < 2 * largest, (peak - baseline, largest)


def test_calibrated_mixed_conversion_streams_with_bounded_memory(tmp_path):
    """The default ``-q`` recipe calibrates on the float model: one decoder layer in float32 at a
    time, not a float32 copy of the whole model (4 bytes per parameter: ~4x this model's shards)."""
    source = tmp_path / "sharded"
    largest = _write_synthetic_sharded(source, n_shards=2, layers_per_shard=3, inter=2816)  # 2 shards of ~78 MB
    out, limit = tmp_path / "out", 8 * 1024**2
    baseline = _conversion_rss(source, out, "baseline", limit)
    peak = _conversion_rss(source, out, "mixed", limit)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["model.layers.0.mlp.down_proj"] == {"group_size": 32, "bits": 4}  # mixed recipe
    whole_model_float32 = 2 * sum(f.stat().st_size for f in source.glob("*.safetensors"))
    print(f"\ncalibrated -q: peak RSS above baseline {(peak - baseline) / 2**20:.0f} MiB, largest shard "
          f"{largest / 2**20:.0f} MiB, whole model in float32 {whole_model_float32 / 2**20:.0f} MiB")
    assert peak - baseline < 2 * largest, (peak - baseline, largest)


# ---------------------------------------------------------------------------- refusals


def _write_unsupported_gguf(path: Path) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    raw = np.zeros((4, 66), dtype=np.uint8)  # 4 rows of one 256-weight IQ2_XXS block (66 bytes) each
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("case", ["exists", "pickle", "gguf_q6k", "bits7", "group48", "requantize", "tokenizer"])
def test_refusals_are_one_line_and_write_nothing(case, tiny_hf, tmp_path, capsys):
    src, dst = str(tiny_hf), tmp_path / "dst"
    extra: list[str] = []
    if case == "exists":
        dst.mkdir()
        (dst / "keep.txt").write_text("old")
    elif case == "pickle":
        src_dir = tmp_path / "pickled"
        src_dir.mkdir()
        (src_dir / "config.json").write_text((tiny_hf / "config.json").read_text())
        (src_dir / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
        src = str(src_dir)
    elif case == "gguf_q6k":
        src = str(tmp_path / "q6k.gguf")
        _write_unsupported_gguf(Path(src))
    elif case == "bits7":
        extra = ["-q", "--q-bits", "7"]
    elif case == "group48":
        extra = ["-q", "--q-group-size", "48"]
    elif case == "requantize":
        src = str(convert(tiny_hf, tmp_path / "already_q", quantize=True, progress=False))
        extra = ["-q"]
    elif case == "tokenizer":  # checked before any weight is written (it was copied, and the output did not load)
        src_dir = tmp_path / "bad_tokenizer"
        shutil.copytree(tiny_hf, src_dir)
        (src_dir / "tokenizer.json").write_text("{not json")
        src = str(src_dir)
    before = sorted(p.name for p in tmp_path.iterdir())
    code = cli_main(["convert", "--hf-path", src, "--mlx-path", str(dst), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and err[0].startswith("mlxformer: error: "), err
    expected = {"exists": "already exists", "pickle": "pickle", "gguf_q6k": "IQ2_XXS", "bits7": "--q-bits 7",
                "group48": "--q-group-size 48", "requantize": "already quantized", "tokenizer": "tokenizer.json"}[case]
    assert expected in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no temp dir
    if case == "exists":
        assert (dst / "keep.txt").read_text() == "old"


def test_failure_mid_conversion_leaves_nothing(tiny_hf, tmp_path, monkeypatch):
    from mlxformer.formats import mlx_writer

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(mlx_writer.mx, "save_safetensors", boom)
    with pytest.raises(OSError):
        convert(tiny_hf, tmp_path / "dst", progress=False)
    assert list(tmp_path.iterdir()) == []


TERMINATED_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import mlxformer.tools.converter as converter
    from mlxformer.cli import main

    def stalled(staging, *args, **kwargs):  # a long write: the staging dir holds a shard
        (Path(staging) / "model-00001-of-00002.safetensors").write_bytes(b"partial")
        print("writing", flush=True)
        time.sleep(60)

    converter.write_shards = stalled
    sys.exit(main(["convert", "--hf-path", sys.argv[1], "--mlx-path", sys.argv[2]]))
""")


def test_sigterm_mid_conversion_leaves_nothing(tiny_hf, tmp_path):
    """``kill`` (SIGTERM) while the shards are written removes the staging dir, as Ctrl-C does
    (it was left behind, holding the finished shards)."""
    import signal

    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", TERMINATED_SCRIPT, str(tiny_hf), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
    assert list(tmp_path.iterdir()) == []
