"""Scoring through the server: ``echo`` with ``logprobs`` returns the prompt tokens' log-probs
(the first ``null``), equal to transformers' log-softmax of the same checkpoint; and
lm-evaluation-harness's ``local-completions`` model runs a local multiple-choice task against
the server, its loglikelihoods equal to the library's own per-token log-probs of the same text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_support import http, running_engine, running_server

TASK_DIR = Path(__file__).parent / "data" / "lm_eval_mc"
TOLERANCE = 2e-3  # float32 MLX vs float32 torch over a 2-layer model


@pytest.fixture(scope="module")
def server(tiny_smol):
    from mlxformer import load

    model, tokenizer = load(tiny_smol[0], threads=1)
    with running_engine(model, tokenizer, max_batch=2) as engine:
        with running_server(engine, model, tokenizer) as url:
            yield url, model, tokenizer


def torch_logprobs(hf_model, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, from transformers."""
    import torch

    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]


def library_logprobs(model, ids: list[int]) -> list[float]:
    """The same from mlxformer's own forward pass (no server)."""
    import mlx.core as mx

    logits = model(mx.array([ids]))[0].astype(mx.float32)  # (T, vocab)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_echo_returns_prompt_logprobs(server, tiny_smol, hf_smollm_tokenizer):
    url, _, tokenizer = server
    prompt = "The quick brown fox jumps over the lazy dog. 🦊"
    ids = hf_smollm_tokenizer(prompt)["input_ids"]
    expected = torch_logprobs(tiny_smol[1], ids)
    for body in ({"prompt": prompt, "max_tokens": 0}, {"prompt": ids, "max_tokens": 1}):
        status, _, raw = http(url, "POST", "/v1/completions", {**body, "echo": True, "logprobs": 2, "temperature": 0})
        assert status == 200, raw
        logprobs = json.loads(raw)["choices"][0]["logprobs"]
        n = len(ids)
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:n] == pytest.approx(expected, abs=TOLERANCE)
        assert len(logprobs["tokens"]) == n + body["max_tokens"]
        for lp, top in zip(logprobs["token_logprobs"][1:n], logprobs["top_logprobs"][1:n]):
            assert len(top) == 2 and max(top.values()) >= lp - 1e-6
        # Byte-level tokens keep their own bytes: the emoji's pieces are "bytes:\x.." strings, and
        # the offsets index the echoed text the way the tokens' bytes add up.
        pieces = [hf_smollm_tokenizer.convert_tokens_to_string([t]) for t in hf_smollm_tokenizer.convert_ids_to_tokens(ids)]
        assert [t for t in logprobs["tokens"][:n] if not t.startswith("bytes:")] == [p for p in pieces if "\ufffd" not in p]
        assert any(t.startswith("bytes:\\x") for t in logprobs["tokens"][:n])
        assert logprobs["text_offset"][:2] == [0, len(pieces[0])]
        assert logprobs["text_offset"][n - 1] <= len(prompt) - 1


def test_lm_eval_local_completions_loglikelihoods_equal_the_library(server, tiny_smol, monkeypatch):
    """lm-eval's own client and task machinery over HTTP; each (context, continuation) score it
    got equals the sum of the library's per-token log-probs of the continuation."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    url, model, _ = server
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(TASK_DIR)  # the task names its data file relative to here
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": url + "/v1/completions", "model": "smollm2-test", "tokenizer": str(tiny_smol[0]),
                    "tokenizer_backend": "huggingface", "num_concurrent": 1, "max_retries": 1},
        tasks=["mc_tiny"], task_manager=TaskManager(include_path=str(TASK_DIR)), log_samples=True,
        bootstrap_iters=0,
    )
    samples = results["samples"]["mc_tiny"]
    assert len(samples) == 4
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(str(tiny_smol[0]))
    checked = 0
    for sample in samples:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
            context_ids = hf_tokenizer(context)["input_ids"]
            whole = hf_tokenizer(context + continuation)["input_ids"]
            assert whole[: len(context_ids)] == context_ids  # lm-eval splits where the tokens do
            expected = sum(library_logprobs(model, whole)[len(context_ids) - 1 :])
            assert response[0][0] == pytest.approx(expected, abs=TOLERANCE), (context, continuation)
            checked += 1
    assert checked == 12
    assert 0.0 <= results["results"]["mc_tiny"]["acc,none"] <= 1.0
