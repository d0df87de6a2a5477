"""Native MTP from GGUF files that llama.cpp's own ``convert_hf_to_gguf.py`` writes from tiny
random Qwen3.5 (``qwen35``), Qwen3-Next (``qwen3next``) and Qwen3.5-MoE (``qwen35moe``, the
default file only) checkpoints with ``mtp.*`` weights
(``test_mtp``'s writer, the vocabulary SmolLM2's so the converter knows the tokenizer):

- by default it appends the MTP layer as the last block (``blk.4.nextn.*`` beside the layer's
  own tensors, ``nextn_predict_layers`` 1), every norm stored as ``1 + w``;
- with ``--mtp`` it writes the head alone (that block, the embedding, output and final norm);
- with ``--no-mtp`` it leaves it out.

The head read from either file gives transformers' MTP logits (``test_mtp.mtp_reference``: its
decoder layer, final norm and ``lm_head`` on ``fc([norm_e(emb), norm_h(h)])``) and those of the
HF checkpoint's head; greedy decoding with it equals plain decoding (library and command line,
``--mtp``, ``--mtp FILE`` and llama.cpp's ways: the file as ``--draft-model``, a hub repo's
``mtp-*.gguf`` beside its model); a GGUF without the block is a one-line error. A q8_0 file's head
is quantized as stored.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from conftest import max_diff, write_tiny_checkpoint
from test_gguf_families import run_converter
from test_mtp import BOUND, CASES, EXPERTS, HYBRID, PROMPT, add_mtp_weights, mtp_reference
from mlxformer import load, stream_generate
from mlxformer.cache import make_cache
from mlxformer.errors import MlxformerError
from mlxformer.speculative.mtp import MTPDrafter, has_mtp_block, load_mtp
from mlxformer.speculative.speculator import SpeculativeSettings

# file kind -> the converter's flags: the head in the model's file, alone, left out
KINDS = {"with-mtp": [], "mtp-only": ["--mtp"], "no-mtp": ["--no-mtp"]}
# Qwen3.5-MoE (``qwen35moe``) too, its default file only; the converter's input says
# ``qwen3_5_text`` (its tokenizer, see test_hybrid_formats), its architectures pick the class
MODELS = {**CASES, "qwen3_5_moe_text": EXPERTS}
HEAD_CASES = [(t, k) for t in CASES for k in ("with-mtp", "mtp-only")] + [("qwen3_5_moe_text", "with-mtp")]
SAME_AS_HF = 3e-4  # the GGUF's head against the HF dir's, float32 both (measured 3.5e-5)
IDS = [int(t) for t in np.random.default_rng(5).integers(3, 256, size=40)]

pytestmark = pytest.mark.usefixtures("cpu_module")


@pytest.fixture(scope="module")
def converted(tmp_path_factory, hf_smollm_tokenizer):
    """model type -> (HF dir, transformers model, reference pieces, {kind: GGUF path}); plus
    ``"q8_0"``: Qwen3.5's file with its head, quantized."""
    root = tmp_path_factory.mktemp("mtp_gguf")
    vocab = len(hf_smollm_tokenizer)
    out, jobs = {}, []
    for model_type, extra in MODELS.items():
        directory, hf_model = write_tiny_checkpoint(root / model_type, model_type, **HYBRID, **extra, vocab_size=vocab)
        hf_smollm_tokenizer.save_pretrained(directory)
        pieces = add_mtp_weights(directory, model_type, hf_model, {**extra, "vocab_size": vocab})
        kinds = KINDS if model_type in CASES else {"with-mtp": []}
        files = {kind: root / f"{model_type}-{kind}.gguf" for kind in kinds}
        source = directory
        if model_type == "qwen3_5_moe_text":
            source = root / "converter_input_moe"
            shutil.copytree(directory, source)
            config = json.loads((source / "config.json").read_text())
            (source / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_5_text"}))
        jobs += [{"name": f"{model_type}-{kind}", "argv": [str(source), "--outtype", "f32", *flags,
                                                            "--outfile", str(files[kind])]}
                 for kind, flags in kinds.items()]
        out[model_type] = (directory, hf_model, pieces, files)
    jobs.append({"name": "q8_0", "argv": [str(out["qwen3_5_text"][0]), "--outtype", "q8_0",
                                          "--outfile", str(root / "q8_0.gguf")]})
    errors = run_converter(root, jobs)
    assert not any(errors.values()), f"llama.cpp's converter failed: {errors}"
    out["q8_0"] = root / "q8_0.gguf"
    return out


def head_logits(model, drafter) -> np.ndarray:
    """The head's logits ``(len(IDS) - 1, vocab)`` over the target's hidden states of ``IDS``."""
    hidden = model.hidden_states(mx.array([IDS]))[:, :-1]
    g = drafter.head(drafter.embed(mx.array([IDS[1:]])), hidden, make_cache(drafter.head))
    return np.array(model.logits(g)[0])


@pytest.mark.parametrize("model_type", list(CASES))
def test_the_files_the_converter_writes(converted, model_type):
    """What the rest relies on: the MTP block is the last block of the default and ``--mtp``
    files (llama.cpp's test for an MTP draft) and absent from the ``--no-mtp`` one."""
    files = converted[model_type][3]
    assert [has_mtp_block(files[kind]) for kind in KINDS] == [True, True, False]
    assert has_mtp_block(converted["qwen3_5_moe_text"][3]["with-mtp"])


@pytest.mark.parametrize(("model_type", "kind"), HEAD_CASES)
def test_gguf_head_matches_transformers_and_the_hf_head(converted, model_type, kind):
    """The head from the model's GGUF, or from the ``--mtp`` file beside the ``--no-mtp`` model,
    gives transformers' MTP logits and the HF checkpoint's head's (the norms' added 1 left in
    would move them by O(1))."""
    directory, hf_model, pieces, files = converted[model_type]
    model, _ = load(files["no-mtp" if kind == "mtp-only" else kind], dtype=mx.float32, threads=1)
    ours = head_logits(model, load_mtp(files[kind], model))
    assert max_diff(ours, mtp_reference(hf_model, pieces, IDS)) <= BOUND
    hf_dir_model, _ = load(directory, dtype=mx.float32, threads=1)
    assert max_diff(ours, head_logits(hf_dir_model, load_mtp(directory, hf_dir_model))) <= SAME_AS_HF


@pytest.mark.parametrize("model_type", list(CASES))
def test_greedy_with_the_gguf_head_equals_plain(converted, model_type):
    model, tokenizer = load(converted[model_type][3]["with-mtp"], dtype=mx.float32, threads=1)
    tokenizer.eos_token_ids = []
    plain = [r.token for r in stream_generate(model, tokenizer, PROMPT, max_tokens=16)]
    settings = SpeculativeSettings(mtp=load_mtp(converted[model_type][3]["with-mtp"], model), num_draft_tokens=3)
    fast = list(stream_generate(model, tokenizer, PROMPT, max_tokens=16, speculative=settings))
    assert [r.token for r in fast] == plain
    assert fast[-1].proposed_tokens > 0


def test_a_q8_0_head_is_quantized_as_stored(converted):
    """The q8_0 file's head: its matrices 8-bit quantized layers (the file's per-layer
    quantization entries renamed with the head), with the logits of the float file's head whose
    matrices gguf-py's Q8_0 rounded (on the q8_0 model's hidden states), and greedy decoding with
    it equals plain."""
    from gguf import GGMLQuantizationType, quants

    path, float_path = converted["q8_0"], converted["qwen3_5_text"][3]["with-mtp"]
    model, tokenizer = load(path, dtype=mx.float32, threads=1)
    tokenizer.eos_token_ids = []
    drafter = load_mtp(path, model)
    quantized = {name: m.bits for name, m in drafter.head.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert quantized.get("fc") == 8 and quantized.get("layers.0.self_attn.q_proj") == 8
    float_model, _ = load(float_path, dtype=mx.float32, threads=1)
    rounded = load_mtp(float_path, float_model).head
    q8_0 = GGMLQuantizationType.Q8_0
    for _, module in rounded.named_modules():
        if isinstance(module, nn.Linear):
            module.weight = mx.array(quants.dequantize(quants.quantize(np.array(module.weight), q8_0), q8_0))
    assert max_diff(head_logits(model, drafter), head_logits(model, MTPDrafter(model, rounded))) <= BOUND
    plain = [r.token for r in stream_generate(model, tokenizer, PROMPT, max_tokens=12)]
    fast = [r.token for r in stream_generate(model, tokenizer, PROMPT, max_tokens=12,
                                             speculative=SpeculativeSettings(mtp=drafter, num_draft_tokens=2))]
    assert fast == plain


def test_mtp_flag_forms_pick_the_file(converted):
    """``--mtp`` reads the model's file, ``--mtp FILE`` that file, and a ``--draft-model`` GGUF
    with an MTP block drafts with its head (llama.cpp's ``-md``); a plain draft model stays one."""
    from mlxformer.cli.common import add_model_args, add_speculative_args, speculative_settings

    files = converted["qwen3_5_text"][3]
    model, tokenizer = load(files["no-mtp"], dtype=mx.float32, threads=1)
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    add_speculative_args(parser)
    for flags in (["--mtp", str(files["mtp-only"])], ["--draft-model", str(files["mtp-only"])]):
        settings = speculative_settings(parser.parse_args(["--model", str(files["no-mtp"]), *flags]), tokenizer, model)
        assert settings.mtp is not None and settings.draft_model is None and settings.num_draft_tokens == 2
    with pytest.raises(MlxformerError, match="no multi-token-prediction weights"):  # --mtp: the model's own file
        speculative_settings(parser.parse_args(["--model", str(files["no-mtp"]), "--mtp"]), tokenizer, model)
    settings = speculative_settings(parser.parse_args(["--draft-model", str(files["no-mtp"])]), tokenizer, model)
    assert settings.mtp is None and settings.draft_model is not None


def run_generate(model, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxformer", "generate", "--model", str(model), "--dtype", "float32",
                           "--threads", "1", "-p", "The sky is", "--ignore-chat-template", "--max-tokens", "12",
                           "--temp", "0", *flags], capture_output=True, text=True, timeout=300, env=env)


def test_generate_mtp_on_the_gguf_equals_plain(converted, tmp_path):
    """``mlxformer generate --mtp`` prints plain decoding's text: on the GGUF with its MTP block,
    and on a hub repo's GGUF without one whose ``mtp-*.gguf`` sits beside it (llama.cpp's
    ``-hf REPO:QUANT --mtp``: the sidecar with the model's tag is picked, a decoy with another tag
    has no head; the sidecars are not models, or ``:F32`` would name two files). Given a GGUF
    without the head, ``--mtp`` is a one-line error, and so is the ``--mtp`` file loaded as a model."""
    from hub_support import add_to_cache
    from test_hub_models import env_for

    files = converted["qwen3_5_text"][3]
    plain = run_generate(files["with-mtp"])
    cache = tmp_path / "hub"
    add_to_cache(cache, "org/tiny-GGUF", {"tiny-F32.gguf": files["no-mtp"], "mtp-tiny-F32.gguf": files["mtp-only"],
                                          "mtp-tiny-Q8_0.gguf": files["no-mtp"]})
    for fast in (run_generate(files["with-mtp"], "--mtp", "--verbose"),
                 run_generate("org/tiny-GGUF:F32", "--mtp", "--verbose", env=env_for(cache))):
        assert plain.returncode == 0 and fast.returncode == 0, plain.stderr + fast.stderr
        assert fast.stdout == plain.stdout and plain.stdout.strip()
        assert "proposed" in fast.stderr
    refused = run_generate(files["no-mtp"], "--mtp")
    assert refused.returncode != 0
    assert refused.stderr.strip().count("\n") == 0 and "no multi-token-prediction weights" in refused.stderr
    with pytest.raises(MlxformerError, match="only a multi-token-prediction head.*--mtp FILE"):
        load(files["mtp-only"])


def test_the_hub_sidecar_is_picked_as_llama_cpp_picks_it():
    """``pick_sidecar`` against the rule of llama.cpp's ``find_best_sibling`` (common/download.cpp):
    only files in the model's folder or above it, the deepest first, then the tag in the name,
    then the nearest quant bits (the tag's, else the model file's)."""
    from mlxformer.formats.hub_gguf import gguf_models, pick_sidecar

    files = dict.fromkeys(["Q4_K_M/m-Q4_K_M.gguf", "Q4_K_M/mtp-m-Q6_K.gguf", "mtp-m-F16.gguf", "mtp-m-Q8_0.gguf",
                           "other/mtp-m-Q4_K_M.gguf"], 1)
    assert pick_sidecar(files, "Q4_K_M/m-Q4_K_M.gguf", "Q4_K_M") == "Q4_K_M/mtp-m-Q6_K.gguf"  # its own folder
    del files["Q4_K_M/mtp-m-Q6_K.gguf"]
    assert pick_sidecar(files, "Q4_K_M/m-Q4_K_M.gguf", "Q4_K_M") == "mtp-m-Q8_0.gguf"  # above it; 8 bits nearer 4
    assert pick_sidecar(dict.fromkeys(["m-Q8_0.gguf", "mtp-m-F16.gguf", "mtp-m-Q4_0.gguf"], 1), "m-Q8_0.gguf",
                        None) == "mtp-m-Q4_0.gguf"  # no tag: the model file's 8 bits
    tagged = dict.fromkeys(["m-Q4_0.gguf", "m-Q4_K_M.gguf", "mtp-m-Q4_0.gguf", "mtp-m-Q4_K_M.gguf"], 1)
    assert [pick_sidecar(tagged, f"m-{t}.gguf", t) for t in ("Q4_0", "q4_k_m")] == ["mtp-m-Q4_0.gguf",
                                                                                    "mtp-m-Q4_K_M.gguf"]
    assert pick_sidecar(dict.fromkeys(["m-Q8_0.gguf", "mmproj-m-Q8_0.gguf"], 1), "m-Q8_0.gguf", "Q8_0") is None
    assert [m.name for m in gguf_models(tagged)] == ["m-Q4_0.gguf", "m-Q4_K_M.gguf"]
