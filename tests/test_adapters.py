"""LoRA/DoRA adapters against their own tools: PEFT adapters trained a few steps on a tiny
transformers Llama (logits of transformers+peft, unmerged and merged), mlx-lm's adapters
(``mlx_lm.load(adapter_path=...)``, float and quantized bases), fused conversion read back by
``mlx_lm.load``, and rows on different adapters batched in one engine step, each as it is alone."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from adapter_support import train_peft_adapter, write_mlx_lm_adapter
from conftest import write_tiny_byte_llama
from mlxformer import load
from mlxformer.adapters import attach_adapters, read_adapter
from mlxformer.adapters.layers import select
from mlxformer.tools.converter import convert
from mlxformer.engine import GenerationRequest
from mlxformer.errors import MlxformerError
from server_support import MODEL_NAME, error_of, http, running_engine, running_server

TOKENS = [[3, 17, 99, 200, 5, 64, 1, 250, 42, 7]]
PEFT = {  # name -> LoraConfig: plain LoRA; DoRA with rsLoRA scaling; per-module rank and alpha
    "lora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "dora": dict(r=2, lora_alpha=4, use_rslora=True, use_dora=True, target_modules=["k_proj", "o_proj", "gate_proj"]),
    "patterns": dict(r=4, lora_alpha=8, rank_pattern={"o_proj": 2}, alpha_pattern={"up_proj": 16},
                     target_modules=["q_proj", "o_proj", "up_proj"]),
}
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> Path:
    """A tiny base written by transformers, PEFT's adapters trained on it, mlx-lm's LoRA and DoRA."""
    root = tmp_path_factory.mktemp("adapters")
    write_tiny_byte_llama(root / "base")
    for seed, (name, config) in enumerate(PEFT.items()):
        train_peft_adapter(root / "base", root / name, seed=seed, **config)
    write_mlx_lm_adapter(root / "base", root / "mlxlm", seed=1)
    write_mlx_lm_adapter(root / "base", root / "mlxlm-dora", seed=2, dora=True, keys=["self_attn.v_proj", "mlp.down_proj"])
    return root


def adapted(base: Path, *names: str, root: Path | None = None, always_on: bool = True):
    """Our float32 load of ``base`` carrying the adapters ``names`` (dirs under ``root``)."""
    model, tokenizer = load(base, dtype=mx.float32)
    tokenizer.eos_token_ids = []
    attach_adapters(model, [read_adapter((root or base.parent) / n) for n in names], list(names), always_on)
    return model, tokenizer


def logits_of(model, tokens=TOKENS) -> np.ndarray:
    return np.array(model(mx.array(tokens)))


@pytest.mark.parametrize("name", list(PEFT))
def test_peft_adapter_logits_match_transformers_peft(adapters: Path, name: str):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(adapters / "base", dtype=torch.float32, attn_implementation="eager")
    reference = PeftModel.from_pretrained(base, adapters / name).eval()
    assert any(float(p.abs().max()) > 0 for n, p in reference.named_parameters() if "lora_B" in n)  # trained
    with torch.no_grad():
        unmerged = reference(input_ids=torch.tensor(TOKENS)).logits.numpy()
        merged = reference.merge_and_unload()(input_ids=torch.tensor(TOKENS)).logits.numpy()
    model, _ = adapted(adapters / "base", name)
    ours = logits_of(model)
    assert np.abs(ours - unmerged).max() < TOLERANCE
    assert np.abs(ours - merged).max() < TOLERANCE
    plain, _ = load(adapters / "base", dtype=mx.float32)
    assert np.abs(logits_of(plain) - unmerged).max() > 0.1  # the adapter changes the output


@pytest.mark.parametrize("name", ["mlxlm", "mlxlm-dora"])
def test_mlx_lm_adapter_matches_mlx_lm(adapters: Path, name: str):
    import mlx_lm

    reference, _ = mlx_lm.load(str(adapters / "base"), adapter_path=str(adapters / name))
    model, _ = adapted(adapters / "base", name)
    assert np.abs(logits_of(model) - np.array(reference(mx.array(TOKENS)))).max() < TOLERANCE


def test_adapter_beside_a_quantized_base_matches_mlx_lm(adapters: Path):
    """A 4-bit base keeps its ``quantized_matmul``; the adapters stay float beside it (mlx-lm's
    LoRA and DoRA layers on its ``QuantizedLinear`` are the reference)."""
    import mlx.nn as nn
    import mlx_lm

    quantized = convert(adapters / "base", adapters / "q4", quantize=True, q_bits=4, q_group_size=32,
                        quant_recipe="uniform", dtype="float32", progress=False)
    for name in ("mlxlm", "mlxlm-dora"):
        reference, _ = mlx_lm.load(str(quantized), adapter_path=str(adapters / name))
        model, _ = adapted(quantized, name, root=adapters)
        assert isinstance(model.layers[0].self_attn.v_proj, nn.QuantizedLinear)
        assert np.abs(logits_of(model) - np.array(reference(mx.array(TOKENS)))).max() < TOLERANCE


@pytest.mark.parametrize("name", ["dora", "mlxlm"])
def test_fused_conversion_read_back_by_mlx_lm(adapters: Path, name: str):
    import mlx_lm

    out = convert(adapters / "base", adapters / f"fused-{name}", adapter=adapters / name, progress=False)
    fused, _ = mlx_lm.load(str(out))
    model, _ = adapted(adapters / "base", name)
    expected = logits_of(model)
    assert np.abs(np.array(fused(mx.array(TOKENS))) - expected).max() < TOLERANCE
    # fused, then quantized: mlx-lm reads it, and it is the adapted model's, not the base's
    out = convert(adapters / "base", adapters / f"fused-q-{name}", adapter=adapters / name, quantize=True,
                  q_bits=8, q_group_size=32, quant_recipe="uniform", progress=False)
    quantized = np.array(mlx_lm.load(str(out))[0](mx.array(TOKENS))).astype(np.float32)
    plain, _ = load(adapters / "base", dtype=mx.float32)
    assert np.abs(quantized - expected).max() < 0.25 * np.abs(logits_of(plain) - expected).max()


def test_rows_on_different_adapters_in_one_forward(adapters: Path):
    """One batched forward over rows on three adapters and none (and the same tokens packed on
    one row, as a packed step runs them) gives each row what it gives alone."""
    names = ["lora", "dora", "mlxlm"]
    model, _ = adapted(adapters / "base", *names, always_on=False)
    bank = model.adapter_bank
    choices = [tuple(bank.vector([(i, 1.0)])) for i in range(3)] + [None]
    rows = [[5 + 7 * r + t for t in range(6)] for r in range(4)]

    class Row:
        def __init__(self, weights):
            self.adapters = weights

    alone = []
    for weights, tokens in zip(choices, rows):
        with select(model, [(Row(weights), len(tokens))]):
            alone.append(logits_of(model, [tokens])[0])
    with select(model, [(Row(w), 1) for w in choices], rows=True):
        together = logits_of(model, rows)
    assert all(np.abs(together[i] - alone[i]).max() < 1e-5 for i in range(4))
    # packed on one row (a packed step's layout): each token's projection takes its own row's adapters
    o_proj = model.layers[0].self_attn.o_proj
    x = mx.random.normal((1, 24, 128), key=mx.random.key(0))
    with select(model, [(Row(w), 6) for w in choices]):
        packed = np.array(o_proj(x))
    for i, weights in enumerate(choices):
        with select(model, [(Row(weights), 6)]):
            assert np.abs(packed[0, 6 * i : 6 * i + 6] - np.array(o_proj(x[:, 6 * i : 6 * i + 6]))[0]).max() < 1e-5
    assert len({float(a[-1].max()) for a in alone}) == 4  # four different models


def collect(handle) -> tuple[list[int], list[float]]:
    events = [e for e in handle if e.token is not None]
    return [e.token for e in events], [e.logprob for e in events]


def test_engine_batches_rows_on_different_adapters(adapters: Path, monkeypatch):
    """Requests on three adapters and none decode in one step (one selection holds several
    adapters' rows) and each gives what it gives alone; the PEFT one gives transformers+peft's
    greedy tokens."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    names = ["lora", "dora", "mlxlm"]
    model, tokenizer = adapted(adapters / "base", *names, always_on=False)
    bank = model.adapter_bank
    mixed = []
    real_select = bank.select

    def watch(weights, keep=None):
        if weights is not None and len({tuple(r) for r in np.array(weights).reshape(-1, 3).tolist()}) > 2:
            mixed.append(weights.shape)
        real_select(weights, keep)

    monkeypatch.setattr(bank, "select", watch)
    prompts = [list(range(10, 40)), list(range(50, 75)), list(range(3, 60)), list(range(100, 120))]
    choices = [tuple(bank.vector([(i, 1.0)])) for i in range(3)] + [None]

    def submit(engine, i):
        return engine.submit(GenerationRequest(prompts[i], max_tokens=10, logprobs=0, adapters=choices[i]))

    with running_engine(model, tokenizer, max_batch=8, prefix_cache_bytes=0, prefill_chunk=16) as engine:
        together = [collect(h) for h in [submit(engine, i) for i in range(4)]]
    assert mixed  # rows on different adapters shared a forward
    with running_engine(model, tokenizer, max_batch=8, prefix_cache_bytes=0, prefill_chunk=16) as engine:
        alone = [collect(submit(engine, i)) for i in range(4)]
    for (tokens, logprobs), (tokens_alone, logprobs_alone) in zip(together, alone):
        assert tokens == tokens_alone
        assert np.abs(np.array(logprobs) - np.array(logprobs_alone)).max() < 1e-4
    for i, name in enumerate(names[:2]):  # PEFT's LoRA and DoRA rows: transformers+peft's greedy tokens
        base = AutoModelForCausalLM.from_pretrained(adapters / "base", dtype=torch.float32, attn_implementation="eager")
        reference = PeftModel.from_pretrained(base, adapters / name).eval()
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompts[i]]), max_new_tokens=10, do_sample=False)
        assert together[i][0] == out[0, len(prompts[i]):].tolist()


def test_prefix_cache_keys_include_the_adapter(adapters: Path):
    """A prompt cached on one adapter serves that adapter again, never the base model or another."""
    model, tokenizer = adapted(adapters / "base", "lora", "dora", always_on=False)
    prompt = list(range(20, 90))  # two whole blocks and a tail
    lora = tuple(model.adapter_bank.vector([(0, 1.0)]))
    with running_engine(model, tokenizer, max_batch=4) as engine:
        def run(weights):
            handle = engine.submit(GenerationRequest(prompt, max_tokens=4, logprobs=0, adapters=weights))
            events = [e for e in handle]
            return [e.token for e in events if e.token is not None], events[-1].cached_tokens

        first, cached_first = run(lora)
        base, cached_base = run(None)
        again, cached_again = run(lora)
    assert (cached_first, cached_base) == (0, 0)
    assert cached_again > 0 and again == first
    assert base != first


def test_pickled_and_malformed_adapters_are_refused(adapters: Path, tmp_path: Path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "adapter_model.bin").write_bytes(b"\x80\x04not read")
    (tmp_path / "bin" / "adapter_config.json").write_text("{}")
    with pytest.raises(MlxformerError, match="pickled .bin is never loaded"):
        read_adapter(tmp_path / "bin")
    with pytest.raises(MlxformerError, match="not a directory"):
        read_adapter(tmp_path / "missing")
    trained_bias = tmp_path / "bias"
    trained_bias.mkdir()
    (trained_bias / "adapter_model.safetensors").write_bytes((adapters / "lora" / "adapter_model.safetensors").read_bytes())
    config = json.loads((adapters / "lora" / "adapter_config.json").read_text())
    (trained_bias / "adapter_config.json").write_text(json.dumps({**config, "bias": "all"}))
    with pytest.raises(MlxformerError, match="bias is not supported"):
        read_adapter(trained_bias)
    # r must be the tensors' rank (the scale is lora_alpha / r; PEFT refuses it as a size mismatch)
    wrong_rank = tmp_path / "rank"
    wrong_rank.mkdir()
    (wrong_rank / "adapter_model.safetensors").write_bytes((adapters / "lora" / "adapter_model.safetensors").read_bytes())
    (wrong_rank / "adapter_config.json").write_text(json.dumps({**config, "r": 2 * config["r"]}))
    with pytest.raises(MlxformerError, match="the tensors' rank is 4"):
        read_adapter(wrong_rank)
    not_finite = tmp_path / "nan"
    not_finite.mkdir()
    tensors = dict(mx.load(str(adapters / "lora" / "adapter_model.safetensors")))
    first = sorted(tensors)[0]
    tensors[first] = mx.full(tensors[first].shape, float("nan"), tensors[first].dtype)
    mx.save_safetensors(str(not_finite / "adapter_model.safetensors"), tensors)
    (not_finite / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(MlxformerError, match="NaN or infinite"):
        read_adapter(not_finite)
    model, tokenizer = load(adapters / "base", dtype=mx.float32)
    bank = attach_adapters(model, [read_adapter(adapters / "dora")], ["dora"])
    with pytest.raises(MlxformerError, match="DoRA"):
        bank.vector([(0, 0.5)])
    with running_engine(model, tokenizer, max_batch=2) as engine:  # a library request's weights are checked
        for weights in ((1.0, 0.0), (float("nan"),)):
            with pytest.raises(MlxformerError, match="adapter weights"):
                engine.submit(GenerationRequest([1, 2, 3], max_tokens=2, adapters=weights))


def test_server_requests_choose_their_adapters(adapters: Path):
    """``lora: [{id, scale}]`` and model ``BASE:NAME`` pick adapters (as the engine runs them),
    ``GET /lora-adapters`` lists them, and a bad choice is an OpenAI-shaped 400."""
    names = ["lora", "dora"]
    model, tokenizer = adapted(adapters / "base", *names, always_on=False)
    prompt = "abcdefgh"

    def completion(url, **extra):
        status, _, body = http(url, "POST", "/v1/completions",
                               {"prompt": prompt, "max_tokens": 6, "temperature": 0, **extra})
        assert status == 200, body
        return json.loads(body)["choices"][0]["text"]

    with running_engine(model, tokenizer, max_batch=4) as engine:
        expected = {}
        for i, name in enumerate([None, *names]):
            weights = None if name is None else tuple(model.adapter_bank.vector([(i - 1, 1.0)]))
            handle = engine.submit(GenerationRequest(tokenizer.encode(prompt), max_tokens=6, adapters=weights))
            expected[name] = "".join(e.text for e in handle)
        with running_server(engine, model, tokenizer) as url:
            status, _, body = http(url, "GET", "/lora-adapters")
            listed = json.loads(body)
            assert status == 200 and [a["name"] for a in listed] == names and [a["id"] for a in listed] == [0, 1]
            assert listed[1]["type"] == "dora"
            models = [m["id"] for m in json.loads(http(url, "GET", "/v1/models")[2])["data"]]
            assert models == [MODEL_NAME, f"{MODEL_NAME}:lora", f"{MODEL_NAME}:dora"]
            assert completion(url) == expected[None]
            assert completion(url, lora=[{"id": 0, "scale": 1.0}]) == expected["lora"]
            assert completion(url, lora=[{"id": "dora"}]) == expected["dora"]
            assert completion(url, model=f"{MODEL_NAME}:dora") == expected["dora"]
            for stream in (False, True):  # the reply names the model as the request chose it
                status, _, raw = http(url, "POST", "/v1/completions",
                                      {"prompt": prompt, "model": f"{MODEL_NAME}:dora", "max_tokens": 2, "stream": stream})
                assert status == 200, raw
                names = {json.loads(line[6:]).get("model") for line in raw.decode().splitlines()
                         if line.startswith("data: {")} if stream else {json.loads(raw)["model"]}
                assert names == {f"{MODEL_NAME}:dora"}, raw
            assert completion(url, lora=[{"id": 0, "scale": 0.0}]) == expected[None]
            for bad, needle in (({"lora": [{"id": 5}]}, "not an adapter"), ({"lora": [{"id": 1, "scale": 0.5}]}, "DoRA"),
                                ({"model": f"{MODEL_NAME}:nothing"}, "does not exist")):
                status, _, body = http(url, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 2, **bad})
                assert status in (400, 404) and needle in error_of(body)["message"]


def test_cli_adapter_flags(adapters: Path, capsys):
    """``generate --adapter`` runs the adapted model; ``convert --adapter`` writes it fused; bad
    flags and adapters are one-line errors."""
    from mlxformer import generate
    from mlxformer.cli import main

    def cli(*argv: str) -> tuple[int, str, str]:
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    base = str(adapters / "base")
    flags = ["--prompt", "abcdefgh", "--max-tokens", "6", "--temp", "0", "--ignore-chat-template", "--dtype", "float32"]
    code, out, _ = cli("generate", "--model", base, "--adapter", str(adapters / "dora"), *flags)
    model, tokenizer = load(base, dtype=mx.float32)
    attach_adapters(model, [read_adapter(adapters / "dora")], ["dora"], always_on=True)
    assert code == 0 and out == generate(model, tokenizer, "abcdefgh", max_tokens=6) + "\n"
    assert cli("generate", "--model", base, *flags)[1] != out
    code, out, _ = cli("convert", "--hf-path", base, "--mlx-path", str(adapters / "cli-fused"), "--adapter",
                       str(adapters / "mlxlm"))
    assert code == 0 and (adapters / "cli-fused" / "config.json").exists()
    for argv, needle in (
        (["generate", "--model", base, "--adapter", str(adapters / "nowhere"), *flags], "not a directory"),
        (["serve", "--model", base, "--lora", "x"], "--lora takes NAME=DIR"),
        (["serve", "--model", base, "--lora", f"a={adapters / 'lora'}", "--adapter", str(adapters / "lora")], "--adapter"),
    ):
        code, out, err = cli(*argv)
        assert code == 1 and err.count("\n") == 1 and err.startswith("mlxformer: error:") and needle in err, err
