"""Every flag of ``generate``, ``chat``, ``bench`` and ``convert``, run in-process through
``mlxformer.cli.main`` on a tiny random Llama with SmolLM2's tokenizer and chat template (saved
by transformers), each with its effect checked against an independent expectation:
transformers (its tokenizer's chat template, its greedy/penalised ``generate`` and its
next-token distribution), Python's ``str.find``, MLX's own ``mx.quantize``/``mx.dequantize``,
and byte counts worked out from the safetensors header and MLX's packed layout.

Flag inventory (where each flag's effect is asserted; the other test modules are named):

| flag | generate | chat | bench | convert |
|---|---|---|---|---|
| --model/-m | here (greedy == transformers) | here | here | n/a |
| --dtype | here (used) | here (used) | here (peak memory drops by 2 bytes/param) | here (scales dtype) |
| --threads/-t | here (2 == 1, CPU pinned); test_bad_input (0) | here (used) | here (used) | n/a |
| --prompt/-p, '-' | here (stdin == argument) | n/a | n/a | n/a |
| --system | here (prompt ids == transformers' template) | here | n/a | n/a |
| --ignore-chat-template | here (raw ids == transformers' encode) | n/a | n/a | n/a |
| --max-tokens | here (N tokens == transformers) | here | n/a | n/a |
| --temp | here (with --seed) | here | n/a | n/a |
| --top-k / --top-p / --min-p | here (draws inside transformers' filtered set; top-k 1 == greedy) | here | n/a | n/a |
| --repetition-penalty | here (== transformers' penalised greedy) | here | n/a | n/a |
| --seed | here (same seed same text, other seed other text; -1 shown with --verbose) | here | n/a | n/a |
| --presence-penalty/--frequency-penalty/--logit-bias | here (== transformers with OpenAI's formula / its sequence bias) | n/a | n/a | n/a |
| bad values (NaN, inf, out of range, --num-draft-tokens 0, --timeout nan) | here (one-line error naming the flag) | n/a | n/a | n/a |
| --stop | here (cut at str.find) | here | n/a | n/a |
| --kv-bits/--kv-group-size/--quantized-kv-start/--max-kv-size | here (== library) ; test_cache (file conflicts) | here (/stats bytes == packed layout) | here (used) | n/a |
| --prompt-cache-file | test_cache (cached == fresh output) | n/a | n/a | n/a |
| --prompt-tokens/--generation-tokens/--trials/--json | n/a | n/a | here (JSON and text) | n/a |
| --hf-path/--mlx-path | n/a | n/a | n/a | here; test_convert; test_hub_models (no --hf-path: the default model) |
| -q/--q-bits/--q-group-size/--quant-recipe | n/a | n/a | n/a | here (== mx.quantize) ; test_convert |
| --dequantize | n/a | n/a | n/a | here (== mx.dequantize) |
| --force | n/a | n/a | n/a | test_convert_destination |
| --verbose | test_bad_input | here | here | here |
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from conftest import cpu_default_device, write_tiny_checkpoint
from mlxformer.cli import main

PROMPT = "Tell me a story."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm_gguf):
    """(dir, transformers float32 model, transformers tokenizer loaded from the dir). The
    tokenizer files are SmolLM2's, saved from the GGUF (transformers reads them back: checked
    against transformers' own GGUF tokenizer in test_tokenizer)."""
    from transformers import AutoTokenizer

    from mlxformer import load

    directory, hf_model = write_tiny_checkpoint(
        tmp_path_factory.mktemp("flags"), "llama", seed=2, vocab_size=49152, head_dim=64, tie_word_embeddings=True
    )  # head_dim 64: KV quantization groups of up to 64
    load(smollm_gguf, threads=1)[1].save(directory)
    return directory, hf_model, AutoTokenizer.from_pretrained(directory)


@pytest.fixture
def cpu():
    """The CPU as default device (``--threads`` > 1 splits work over CPU streams)."""
    with cpu_default_device():
        yield


def run(capsys, *argv: str) -> tuple[str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


def float32(flags: tuple[str, ...]) -> list[str]:
    """``flags`` computing in float32 like the transformers references, unless they name a
    dtype (on a GPU the default for this float32 checkpoint would be bfloat16)."""
    return [*flags] if "--dtype" in flags else [*flags, "--dtype", "float32"]


def generate(capsys, tiny, *flags: str) -> tuple[str, str]:
    """stdout without the final newline, and stderr, of ``generate`` on the tiny model."""
    out, err = run(capsys, "generate", "--model", str(tiny[0]), *float32(flags))
    assert out.endswith("\n")
    return out[:-1], err


def prompt_tokens(err: str) -> int:
    return int(err.split("prompt: ")[1].split()[0])


def template_ids(tokenizer, system: str | None = None, user: str = PROMPT) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def hf_greedy(tiny, ids: list[int], n: int, **kwargs) -> str:
    """transformers' greedy continuation of ``ids`` (stopping at eos), decoded."""
    import torch

    _, model, tokenizer = tiny
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.eos_token_id, **kwargs)[0, len(ids):].tolist()
    return tokenizer.decode([t for t in out if t != tokenizer.eos_token_id])


def next_token_probs(tiny, ids: list[int], temp: float) -> np.ndarray:
    import torch

    with torch.no_grad():
        logits = tiny[1](torch.tensor([ids])).logits[0, -1].double()
    return torch.softmax(logits / temp, -1).numpy()


# ---------------------------------------------------------------------------- generate


@pytest.mark.parametrize("mode", ["template", "system", "raw"])
def test_generate_greedy_prompt_ids_and_text_match_transformers(tiny, capsys, mode):
    tokenizer = tiny[2]
    flags = {"template": [], "system": ["--system", "Answer like a pirate."], "raw": ["--ignore-chat-template"]}[mode]
    ids = {"template": template_ids(tokenizer), "system": template_ids(tokenizer, "Answer like a pirate."),
           "raw": tokenizer.encode(PROMPT)}[mode]
    if mode != "template":
        assert ids != template_ids(tokenizer)
    text, err = generate(capsys, tiny, "--prompt", PROMPT, "--max-tokens", "10", "--temp", "0", "--dtype", "float32",
                         *flags)
    assert prompt_tokens(err) == len(ids)
    assert "generation: 10 tokens" in err
    assert text == hf_greedy(tiny, ids, 10)


def test_generate_reads_the_prompt_from_stdin(tiny, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT))
    text, err = generate(capsys, tiny, "--prompt", "-", "--max-tokens", "6")
    assert prompt_tokens(err) == len(template_ids(tiny[2]))
    assert text == hf_greedy(tiny, template_ids(tiny[2]), 6)


def test_generate_stop_cuts_at_the_first_occurrence(tiny, capsys):
    full = hf_greedy(tiny, template_ids(tiny[2]), 12)
    stop = full[9:12]
    assert len(stop) == 3 and full.find(stop) > 0
    text, _ = generate(capsys, tiny, "--prompt", PROMPT, "--max-tokens", "12", "--stop", "never-there", "--stop", stop)
    assert text == full[: full.find(stop)]


def test_generate_seed_reproduces_and_other_seeds_differ(tiny, capsys):
    def sample(seed: str) -> str:
        return generate(capsys, tiny, "--prompt", PROMPT, "--max-tokens", "8", "--temp", "1.0", "--seed", seed)[0]

    first = sample("1")
    assert sample("1") == first
    assert sample("2") != first
    assert first != hf_greedy(tiny, template_ids(tiny[2]), 8)


def test_generate_top_k_1_is_greedy(tiny, capsys):
    text, _ = generate(capsys, tiny, "--prompt", PROMPT, "--max-tokens", "8", "--temp", "1.0", "--top-k", "1",
                       "--seed", "5")
    assert text == hf_greedy(tiny, template_ids(tiny[2]), 8)


@pytest.mark.parametrize("flag,value", [("--top-k", "3"), ("--top-p", "0.037"), ("--min-p", "0.38")])
def test_generate_filters_keep_what_transformers_keeps(tiny, capsys, flag, value):
    """First tokens drawn at temperature 1 with each filter lie in the set that the filter keeps
    of transformers' next-token distribution (top-3: 0.0230, 0.0096, 0.0091; the 4th is 0.0085),
    and the draws are not all the top token."""
    tokenizer = tiny[2]
    probs = next_token_probs(tiny, template_ids(tokenizer), 1.0)
    order = np.argsort(-probs)
    if flag == "--top-k":
        kept = order[: int(value)]
    elif flag == "--top-p":  # the smallest top set with at least that mass
        kept = order[: int(np.searchsorted(np.cumsum(probs[order]), float(value))) + 1]
    else:
        kept = np.flatnonzero(probs >= float(value) * probs.max())
    assert 2 <= len(kept) <= 3
    allowed = {tokenizer.decode([int(t)]) for t in kept}
    drawn = [generate(capsys, tiny, "--prompt", PROMPT, "--max-tokens", "1", "--temp", "1.0", flag, value,
                      "--seed", str(seed))[0] for seed in range(8)]
    assert set(drawn) <= allowed, (drawn, allowed)
    assert len(set(drawn)) >= 2


def test_generate_repetition_penalty_matches_transformers(tiny, capsys):
    ids = template_ids(tiny[2])  # prompt + generation < 64 tokens: the whole context is penalised, as in transformers
    expected = hf_greedy(tiny, ids, 16, repetition_penalty=1.5)
    assert expected != hf_greedy(tiny, ids, 16)
    text, _ = generate(capsys, tiny, "--prompt", PROMPT, "--max-tokens", "16", "--repetition-penalty", "1.5")
    assert text == expected


class OpenAIPenalties:
    """OpenAI's presence/frequency penalties (its API reference: ``mu[j] -> mu[j] - c[j] *
    alpha_frequency - float(c[j] > 0) * alpha_presence`` over the tokens sampled so far), as a
    transformers logits processor."""

    def __init__(self, prompt_length: int, presence: float, frequency: float) -> None:
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids, scores):
        import torch

        counts = torch.bincount(input_ids[0, self.prompt_length:], minlength=scores.shape[-1]).to(scores.dtype)
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def test_generate_openai_penalties_and_logit_bias_match_transformers(tiny, capsys):
    from transformers import LogitsProcessorList

    ids = template_ids(tiny[2])
    plain = hf_greedy(tiny, ids, 12)
    penalties = LogitsProcessorList([OpenAIPenalties(len(ids), 0.7, 1.3)])
    expected = hf_greedy(tiny, ids, 12, logits_processor=penalties)
    assert expected != plain
    text, _ = generate(capsys, tiny, "--prompt", PROMPT, "--max-tokens", "12", "--presence-penalty", "0.7",
                       "--frequency-penalty", "1.3")
    assert text == expected
    token = int(np.argsort(-next_token_probs(tiny, ids, 1.0))[1])  # the runner-up first token
    expected = hf_greedy(tiny, ids, 12, sequence_bias={(token,): 3.0})
    assert expected != plain
    text, _ = generate(capsys, tiny, "--prompt", PROMPT, "--max-tokens", "12", "--logit-bias", f"{token}=3")
    assert text == expected


def test_generate_seed_minus_one_is_random_and_shown_with_verbose(tiny, capsys):
    flags = ("--prompt", PROMPT, "--max-tokens", "8", "--temp", "1.0")
    text, err = generate(capsys, tiny, *flags, "--seed", "-1", "--verbose")
    seed = int(err.split("mlxformer: seed ")[1].split()[0])
    assert generate(capsys, tiny, *flags, "--seed", str(seed))[0] == text
    assert generate(capsys, tiny, *flags, "--seed", str(2**64 - 1))[0]  # the largest seed MLX takes


@pytest.mark.parametrize("flags,flag", [
    (("--temp", "nan"), "--temp"), (("--temp", "1", "--top-p", "inf"), "--top-p"), (("--min-p", "nan"), "--min-p"),
    (("--repetition-penalty", "nan"), "--repetition-penalty"), (("--presence-penalty", "inf"), "--presence-penalty"),
    (("--frequency-penalty=-inf",), "--frequency-penalty"), (("--logit-bias", "5=nan"), "--logit-bias"),
    (("--logit-bias", "five"), "--logit-bias"), (("--seed", "-2"), "--seed"), (("--seed", str(2**64)), "--seed"),
    (("--prompt-lookup", "--num-draft-tokens", "0"), "--num-draft-tokens"),
    (("--parallel", "tensor", "--timeout", "nan"), "--timeout"),
    (("--quantized-kv-start", "-3"), "--quantized-kv-start"), (("--max-kv-size", "0"), "--max-kv-size"),
    (("--max-kv-size", "4"), "--max-kv-size"),  # no room past the 4 sink tokens it keeps (it generated junk)
])
def test_bad_values_are_one_line_errors_naming_the_flag(tiny, capsys, flags, flag):
    assert main(["generate", "--model", str(tiny[0]), "--prompt", PROMPT, "--max-tokens", "2", *flags]) == 1
    out, err = capsys.readouterr()
    assert not out and len(err.strip().splitlines()) == 1 and err.startswith(f"mlxformer: error: {flag} must"), err


def test_generate_threads_do_not_change_the_output(tiny, capsys, cpu):
    one, _ = generate(capsys, tiny, "--prompt", PROMPT, "--max-tokens", "10", "--threads", "1")
    two, _ = generate(capsys, tiny, "--prompt", PROMPT, "--max-tokens", "10", "-t", "2")
    assert one == two == hf_greedy(tiny, template_ids(tiny[2]), 10)


def test_generate_cache_flags_reach_the_cache(tiny, capsys):
    """The CLI's text equals the library's with the same ``CacheSettings`` (the caches' own
    behaviour is checked against references in test_cache; their byte sizes in the chat test)."""
    from mlxformer import generate as library_generate, load
    from mlxformer.cache import CacheSettings

    flags = ["--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "8", "--max-kv-size", "24"]
    text, _ = generate(capsys, tiny, "--prompt", PROMPT, "--max-tokens", "12", *flags)
    model, tokenizer = load(tiny[0], dtype=mx.float32)
    ids = tokenizer.encode_prompt(PROMPT)
    settings = CacheSettings(kv_bits=4, kv_group_size=32, quantized_kv_start=8, max_kv_size=24)
    assert text == library_generate(model, tokenizer, ids, 12, cache_settings=settings)
    assert text != library_generate(model, tokenizer, ids, 12)  # a 24-token window over a 47-token context


# ---------------------------------------------------------------------------- chat


def chat(capsys, monkeypatch, tiny, lines: str, *flags: str) -> str:
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    return run(capsys, "chat", "-m", str(tiny[0]), *float32(flags))[0]


def test_chat_system_and_sampling_flags(tiny, capsys, monkeypatch):
    """top-k 1 makes the sampler greedy whatever --temp/--top-p/--min-p/--seed: the reply is
    transformers' penalised greedy continuation of the template with the system message, cut
    at the stop string."""
    ids = template_ids(tiny[2], "You are terse.", "Hi")
    full = hf_greedy(tiny, ids, 12, repetition_penalty=1.3)
    stop = full[6:9]
    out = chat(capsys, monkeypatch, tiny, "Hi\n/stats\n/exit\n", "--system", "You are terse.", "--max-tokens", "12",
               "--temp", "0.8", "--top-k", "1", "--top-p", "0.9", "--min-p", "0.05", "--seed", "3",
               "--repetition-penalty", "1.3", "--stop", stop, "--dtype", "float32", "--threads", "1")
    reply, stats = out.split("\n")[:2]
    assert reply == full[: full.find(stop)]
    assert stats.startswith("context: ")


def cache_megabytes(out: str) -> tuple[int, float]:
    stats = next(line for line in out.splitlines() if line.startswith("context:"))
    return int(stats.split()[1]), float(stats.split("cache: ")[1].split()[0])


def test_chat_cache_flags_set_the_cache_size(tiny, capsys, monkeypatch):
    """/stats bytes against MLX's layouts: float32 keys+values take 2 x layers x kv_heads x
    head_dim x 4 bytes per token; b-bit groups of g take b/8 bytes per value plus a float32
    scale and bias per group; the growing cache allocates ``KVCache.step`` (256) tokens at a
    time, a rotating window exactly --max-kv-size tokens."""
    from mlxformer.cache import KVCache

    per_token = 2 * 2 * 2 * 64  # (keys, values) x layers x kv heads x head_dim of the tiny model
    capacity = KVCache.step
    base = ["--max-tokens", "4"]
    tokens, float_mb = cache_megabytes(chat(capsys, monkeypatch, tiny, "Hi\n/stats\n", *base))
    assert tokens < capacity and float_mb == pytest.approx(capacity * per_token * 4 / 1e6, abs=0.006)
    for bits, group in ((8, 32), (4, 64)):
        flags = ["--kv-bits", str(bits), "--kv-group-size", str(group)]
        n, mb = cache_megabytes(chat(capsys, monkeypatch, tiny, "Hi\n/stats\n", *base, *flags))
        assert n == tokens
        assert mb == pytest.approx(capacity * per_token * (bits / 8 + 2 * 4 / group) / 1e6, abs=0.006), (bits, group)
    n, mb = cache_megabytes(chat(capsys, monkeypatch, tiny, "Hi\n/stats\n", *base, "--kv-bits", "8",
                                 "--quantized-kv-start", "1000"))
    assert mb == float_mb  # not yet quantized
    n, mb = cache_megabytes(chat(capsys, monkeypatch, tiny, "Hi\n/stats\n", *base, "--max-kv-size", "16"))
    assert n == tokens and mb == pytest.approx(16 * per_token * 4 / 1e6, abs=0.006)


# ---------------------------------------------------------------------------- bench


def test_bench_json_and_text(tiny, capsys):
    out, _ = run(capsys, "bench", "-m", str(tiny[0]), "--prompt-tokens", "12", "--generation-tokens", "3",
                 "--trials", "2", "--json", "--threads", "1", "--kv-bits", "8", "--kv-group-size", "32",
                 "--quantized-kv-start", "4", "--max-kv-size", "10")
    report = json.loads(out)
    assert len(report["trials"]) == 2
    assert all(t["prompt_tokens"] == 12 and t["generation_tokens"] == 3 for t in report["trials"])
    assert report["median"]["decode_tps"] > 0
    out, err = run(capsys, "bench", "-m", str(tiny[0]), "--prompt-tokens", "8", "--generation-tokens", "2",
                   "--trials", "3")
    lines = out.strip().splitlines()
    assert [line.split(":")[0].strip() for line in lines] == ["trial 1", "trial 2", "trial 3", "median"]
    # progress on stderr, what starts before it runs (a real model's bench takes minutes)
    assert err.splitlines() == [f"mlxformer: loading {tiny[0]}", "mlxformer: warming up"] + [
        f"mlxformer: trial {i}/3: 8 prompt tokens, then 2 generated" for i in (1, 2, 3)]


def test_bench_dtype_halves_the_weights(tiny, capsys):
    """Peak memory includes the weights: bfloat16 saves 2 bytes per parameter against float32
    (parameter count from the safetensors header)."""
    from safetensors import safe_open

    with safe_open(str(tiny[0] / "model.safetensors"), "np") as f:
        params = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
    peaks = {}
    for dtype in ("float32", "bfloat16"):
        out, _ = run(capsys, "bench", "-m", str(tiny[0]), "--prompt-tokens", "4", "--generation-tokens", "2",
                     "--trials", "1", "--json", "--dtype", dtype)
        peaks[dtype] = json.loads(out)["median"]["peak_memory_gb"] * 1e9
    assert peaks["float32"] - peaks["bfloat16"] == pytest.approx(2 * params, rel=0.25)


# ---------------------------------------------------------------------------- convert


def test_convert_quantization_flags_match_mx_quantize(tiny, tmp_path, capsys):
    out_dir = tmp_path / "q8"
    out, _ = run(capsys, "convert", "--hf-path", str(tiny[0]), "--mlx-path", str(out_dir), "-q", "--q-bits", "8",
                 "--q-group-size", "32", "--quant-recipe", "rtn", "--dtype", "float32")
    assert out.strip() == f"wrote {out_dir}"
    config = json.loads((out_dir / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    source = mx.load(str(tiny[0] / "model.safetensors"))
    ours = mx.load(str(out_dir / "model.safetensors"))
    for name in ("model.embed_tokens", "model.layers.1.mlp.down_proj"):
        expected = mx.quantize(source[f"{name}.weight"].astype(mx.float32), group_size=32, bits=8)
        for key, array in zip(("weight", "scales", "biases"), expected):
            assert ours[f"{name}.{key}"].dtype == array.dtype and mx.array_equal(ours[f"{name}.{key}"], array), key

    floats = tmp_path / "floats"
    run(capsys, "convert", "--hf-path", str(out_dir), "--mlx-path", str(floats), "--dequantize", "--dtype", "float32")
    assert "quantization" not in json.loads((floats / "config.json").read_text())
    back = mx.load(str(floats / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj"
    expected = mx.dequantize(ours[f"{name}.weight"], ours[f"{name}.scales"], ours[f"{name}.biases"], group_size=32,
                             bits=8)
    assert mx.array_equal(back[f"{name}.weight"], expected)


@pytest.mark.parametrize("command", ["chat", "bench", "convert"])
def test_verbose_shows_a_traceback(tmp_path, capsys, monkeypatch, command):
    missing = str(tmp_path / "missing")
    argv = ["convert", "--hf-path", missing, "--mlx-path", str(tmp_path / "out")] if command == "convert" \
        else [command, "--model", missing]
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main([*argv, "--verbose"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.strip().splitlines()[-1].startswith("mlxformer: error:")
    assert main(argv) == 1
    assert "Traceback" not in capsys.readouterr().err
