"""A model's sampling defaults (generation_config.json, GGUF ``general.sampling.*``) apply when
neither a flag nor a request field sets them: one rule for the CLI and the server
(``mlxformer/sampling/model_defaults.py``). References: transformers' ``GenerationConfig`` and its
``generate`` with the model's own generation config; gguf-py's key names."""

from __future__ import annotations

import json
import shutil

import gguf
import pytest
import torch

from mlxformer.cli import main
from mlxformer.sampling.model_defaults import SamplingDefaults

PROMPT = "Tell me a story."
# top_k 1 makes sampling deterministic; the penalty makes it differ from plain greedy
SAMPLING_CONFIG = {"do_sample": True, "temperature": 0.9, "top_k": 1, "top_p": 0.95, "repetition_penalty": 3.0}


@pytest.fixture(scope="module")
def with_defaults(tiny_smol, tmp_path_factory):
    """tiny_smol's files plus a generation_config.json that sets sampling defaults."""
    directory = tmp_path_factory.mktemp("defaults") / "model"
    shutil.copytree(tiny_smol[0], directory)
    config = json.loads((directory / "generation_config.json").read_text()) if (
        directory / "generation_config.json").is_file() else {}
    (directory / "generation_config.json").write_text(json.dumps({**config, **SAMPLING_CONFIG}))
    return directory, tiny_smol[1]


def test_defaults_are_what_transformers_reads(with_defaults):
    from transformers import GenerationConfig

    reference = GenerationConfig.from_pretrained(with_defaults[0])
    defaults = SamplingDefaults.of_checkpoint(with_defaults[0], None)
    assert defaults.as_dict() == {"temp": reference.temperature, "top_p": reference.top_p, "top_k": reference.top_k,
                                  "repetition_penalty": reference.repetition_penalty}
    # without do_sample transformers decodes greedily: the temperature is not a default then
    assert SamplingDefaults.from_generation_config({"temperature": 0.7, "top_k": 5}).as_dict() == {"top_k": 5}


def test_gguf_sampling_metadata_is_read():
    keys = gguf.Keys.General
    metadata = {keys.SAMPLING_TEMP: 0.6, keys.SAMPLING_TOP_P: 0.9, keys.SAMPLING_TOP_K: 40,
                keys.SAMPLING_MIN_P: 0.05, keys.SAMPLING_PENALTY_REPEAT: 1.1, keys.SAMPLING_XTC_PROBABILITY: 0.5}
    assert SamplingDefaults.from_gguf(metadata).as_dict() == {
        "temp": 0.6, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1}
    assert SamplingDefaults.from_gguf({keys.SAMPLING_TOP_P: 0.0}).as_dict() == {}  # out of range: dropped


def hf_generate(with_defaults, ids: list[int], n: int, **overrides) -> list[int]:
    """transformers' generate with the checkpoint's own generation config (plus ``overrides``)."""
    from transformers import GenerationConfig

    config = GenerationConfig.from_pretrained(with_defaults[0], max_new_tokens=n, min_new_tokens=n, **overrides)
    return with_defaults[1].generate(torch.tensor([ids]), generation_config=config,
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()


def prompt_ids(directory) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def cli_generate(capsys, directory, *flags: str) -> str:
    code = main(["generate", "--model", str(directory), "--prompt", PROMPT, "--max-tokens", "24",
                 "--dtype", "float32", *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out[:-1]


def test_cli_applies_the_model_defaults_and_flags_win(with_defaults, capsys):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(with_defaults[0])
    ids = prompt_ids(with_defaults[0])
    penalised = hf_generate(with_defaults, ids, 24)
    plain = hf_generate(with_defaults, ids, 24, do_sample=False, repetition_penalty=1.0)
    assert penalised != plain
    assert cli_generate(capsys, with_defaults[0]) == tokenizer.decode(penalised)
    assert cli_generate(capsys, with_defaults[0], "--temp", "0", "--repetition-penalty", "1") == tokenizer.decode(plain)


def test_info_prints_the_defaults(with_defaults, capsys):
    assert main(["info", "--model", str(with_defaults[0])]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("sampling defaults")]
    assert line == ["sampling defaults (unless a flag or request sets them): temp 0.9, top_p 0.95, top_k 1, "
                    "repetition_penalty 3"]


def test_server_requests_take_the_defaults_unless_they_set_them(with_defaults):
    from mlxformer import load
    from mlxformer.server.protocol import ChatCompletionRequest
    from mlxformer.server.translate import ServedModel, engine_request

    model, tokenizer = load(with_defaults[0])
    served = ServedModel.of("m", model, tokenizer)

    def sampling(**fields):
        body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)
        return engine_request(body, [1, 2, 3], served, max_tokens=4, logprobs=None).sampling

    left_out = sampling()
    assert (left_out.temp, left_out.top_k, left_out.top_p, left_out.repetition_penalty) == (0.9, 1, 0.95, 3.0)
    given = sampling(temperature=0.0, top_p=1.0, repetition_penalty=1.0)
    assert (given.temp, given.top_k, given.top_p, given.repetition_penalty) == (0.0, 1, 1.0, 1.0)
