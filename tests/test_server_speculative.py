"""`mlxformer serve --prompt-lookup` and `--draft-model`: greedy replies through the openai
client (concurrent, whole and streamed) equal plain `generate`'s; bad flag use is a one-line error."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from server_support import serve_subprocess

from conftest import write_tiny_checkpoint
from mlxformer import generate, load
from test_speculative import SHAPE, write_word_tokenizer

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 11, 12, 5, 6, 7, 8, 9, 13, 5, 6, 7],
    [20, 21, 22, 20, 21, 22, 20, 21],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 40, 41, 42, 43],
]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("served")
    write_tiny_checkpoint(directory, "llama", vocab_size=256, **SHAPE)
    write_word_tokenizer(directory, 256)
    return directory


@pytest.mark.parametrize("flags", [["--prompt-lookup", "--num-draft-tokens", "5"], ["--draft-model", "SELF"]])
def test_speculative_serve_equals_plain_generate(tiny_dir, flags):
    model, tokenizer = load(tiny_dir, threads=1)
    expected = [generate(model, tokenizer, ids, MAX_TOKENS) for ids in PROMPTS]
    flags = [str(tiny_dir) if f == "SELF" else f for f in flags]  # the target drafting for itself
    command = [sys.executable, "-m", "mlxformer", "serve", "--model", str(tiny_dir), "--threads", "1", "--served-model-name", "m", *flags]
    with serve_subprocess(command) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)

        def complete(ids: list[int]):
            return client.completions.create(model="m", prompt=ids, max_tokens=MAX_TOKENS, temperature=0)

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            replies = list(pool.map(complete, PROMPTS))
        assert [r.choices[0].text for r in replies] == expected
        details = [r.usage.completion_tokens_details for r in replies if r.usage.completion_tokens_details]
        assert sum(d.accepted_prediction_tokens + d.rejected_prediction_tokens for d in details) > 0  # proposals
        if "--draft-model" in flags:  # the target drafting for itself: its proposals hold
            assert sum(d.accepted_prediction_tokens for d in details) > 0
        stream = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected[0]


def test_num_draft_tokens_alone_is_refused(tiny_dir):
    result = subprocess.run(
        [sys.executable, "-m", "mlxformer", "serve", "--model", str(tiny_dir), "--num-draft-tokens", "3"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.strip() == "mlxformer: error: --num-draft-tokens needs --prompt-lookup, --draft-model or --mtp"
