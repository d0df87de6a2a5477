"""Scoring through the server, on conftest's tiny float32 llama over SmolLM2's tokenizer and chat
template, against transformers on the same directory.

- OpenAI's log-prob contract: with ``echo`` one entry per prompt token (the first ``null``), and
  one per generated token, an end-of-sequence token and the tokens of a stop string included
  (whatever text they add), on completions and chat, streamed and whole; the values equal
  transformers' float64 log-softmax within 1e-5.
- lm-evaluation-harness, offline: three local tasks written here (multiple choice,
  ``loglikelihood_rolling``, ``generate_until``) through ``local-completions`` (``num_concurrent``
  1 and 4) and ``local-chat-completions`` against the server, beside lm-eval's own ``hf`` backend
  on the same directory: log-likelihoods within 2e-5 per item, identical greedy strings, and
  concurrency changes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from server_support import MODEL_NAME, http, running_engine, running_server

TOLERANCE = 1e-5  # one token's log-prob: float32 MLX vs float32 torch (log-softmax in float64)
ITEM_TOLERANCE = 2e-5  # an lm-eval item: a sum of up to ~40 of them
MESSAGES = [{"role": "user", "content": "Name a color."}]
PROMPT = "The quick brown fox jumps over the lazy dog. 🦊"


@pytest.fixture(scope="module")
def server(tiny_smol):
    """``serve``'s app over the float32 checkpoint directory on 127.0.0.1, room for 4 rows."""
    import mlx.core as mx

    from mlxformer import load

    model, tokenizer = load(tiny_smol[0], dtype=mx.float32, threads=1)
    with running_engine(model, tokenizer, max_batch=4) as engine:
        with running_server(engine, model, tokenizer) as url:
            yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def torch_logprobs(hf_model, ids: list[int], bias: dict[int, float] | None = None):
    """transformers' log-softmax of ``ids``' logits in float64 ``(T, vocab)``: row ``i``
    predicts token ``i + 1`` (``bias`` added to the logits first, as ``logit_bias`` is)."""
    import torch

    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].double()
    for token, value in (bias or {}).items():
        logits[:, token] += value
    return torch.log_softmax(logits, dim=-1)


def greedy_reference(hf_model, ids: list[int], n: int) -> list[tuple[int, float]]:
    """transformers' ``n`` greedy tokens after ``ids`` and their log-probs."""
    import torch

    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    tokens = out[0, len(ids):].tolist()
    rows = torch_logprobs(hf_model, ids + tokens[:-1])[len(ids) - 1:]
    return [(t, rows[i, t].item()) for i, t in enumerate(tokens)]


def token_string(hf_tokenizer, token: int) -> str | None:
    """The token's text as logprobs show it (None for a partial UTF-8 sequence: ``bytes:`` there)."""
    text = hf_tokenizer.convert_tokens_to_string([hf_tokenizer.convert_ids_to_tokens(token)])
    return None if "\ufffd" in text else text


def chat_ids(hf_tokenizer) -> list[int]:
    return hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)


def generate(client, api: str, stream: bool, **body: Any) -> tuple[str, list[tuple[str, float]], str, Any, Any]:
    """One request through the official client: ``(text, [(token, logprob)], finish_reason,
    usage, the completion's joined logprobs or None)``, a stream's pieces joined in order."""
    if stream:
        body["stream_options"] = {"include_usage": True}
    if api == "chat":
        reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0, logprobs=True,
                                               stream=stream, **body)
    else:
        reply = client.completions.create(model=MODEL_NAME, temperature=0, stream=stream, **body)
    replies = list(reply) if stream else [reply]
    choices = [r.choices[0] for r in replies if r.choices]
    if api == "chat":
        text = "".join((c.delta if stream else c.message).content or "" for c in choices)
        entries = [(e.token, e.logprob) for c in choices if c.logprobs for e in c.logprobs.content or []]
        return text, entries, choices[-1].finish_reason, replies[-1].usage, None
    joined: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for choice in choices:
        for key in joined:
            joined[key] += getattr(choice.logprobs, key) if choice.logprobs else []
    entries = list(zip(joined["tokens"], joined["token_logprobs"]))
    return "".join(c.text for c in choices), entries, choices[-1].finish_reason, replies[-1].usage, joined


def test_echo_returns_prompt_logprobs(server, tiny_smol, hf_smollm_tokenizer):
    """The prompt's entries (the first ``null``) for a text and a token-id prompt; byte-level
    tokens keep their own bytes (the emoji's pieces are ``bytes:\\x..`` strings) and the
    offsets index the echoed text the way the tokens' bytes add up."""
    ids = hf_smollm_tokenizer(PROMPT)["input_ids"]
    rows = torch_logprobs(tiny_smol[1], ids)
    expected = [rows[i - 1, ids[i]].item() for i in range(1, len(ids))]
    for body in ({"prompt": PROMPT, "max_tokens": 0}, {"prompt": ids, "max_tokens": 1}):
        status, _, raw = http(server, "POST", "/v1/completions", {**body, "echo": True, "logprobs": 2, "temperature": 0})
        assert status == 200, raw
        logprobs = json.loads(raw)["choices"][0]["logprobs"]
        n = len(ids)
        assert len(logprobs["tokens"]) == n + body["max_tokens"]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:n] == pytest.approx(expected, abs=TOLERANCE)
        for lp, top in zip(logprobs["token_logprobs"][1:n], logprobs["top_logprobs"][1:n]):
            assert len(top) == 2 and max(top.values()) >= lp
        strings = [token_string(hf_smollm_tokenizer, i) for i in ids]
        assert [t for t in logprobs["tokens"][:n] if not t.startswith("bytes:")] == [s for s in strings if s]
        assert any(t.startswith("bytes:\\x") for t in logprobs["tokens"][:n])
        assert logprobs["text_offset"][:2] == [0, len(strings[0])]
        assert logprobs["text_offset"][n - 1] <= len(PROMPT) - 1


def test_echo_offsets_index_control_tokens_in_the_prompt(server, tiny_smol, hf_smollm_tokenizer):
    """A prompt that writes the chat template's control tokens: each token's ``text_offset``
    is where its text starts in the echoed text (they counted as zero-width, so ``user``'s
    offset pointed into ``<|im_start|>``); the log-probs are transformers'."""
    prompt = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    ids = hf_smollm_tokenizer(prompt)["input_ids"]
    rows = torch_logprobs(tiny_smol[1], ids)
    status, _, raw = http(server, "POST", "/v1/completions",
                          {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"] == prompt and len(logprobs["tokens"]) == len(ids)
    assert logprobs["tokens"][0] == "<|im_start|>"
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"]):
        assert prompt[offset:].startswith(token), (token, offset)
    expected = [rows[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=TOLERANCE)


def test_a_prompt_of_the_whole_context_is_scored(tiny_smol, tmp_path):
    """``max_tokens: 0`` scores a prompt as long as the context (it was refused: no room left to
    generate); one token more, or any token to generate, is still a 400."""
    import shutil

    import mlx.core as mx

    from conftest import edit_config
    from mlxformer import load

    directory = tmp_path / "short"
    shutil.copytree(tiny_smol[0], directory)
    edit_config(directory, max_position_embeddings=48)
    model, tokenizer = load(directory, dtype=mx.float32, threads=1)
    ids = [(37 * i) % 1000 + 100 for i in range(48)]
    rows = torch_logprobs(tiny_smol[1], ids)
    with running_engine(model, tokenizer, max_batch=2) as engine, running_server(engine, model, tokenizer) as url:
        status, _, raw = http(url, "POST", "/v1/completions",
                              {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1})
        assert status == 200, raw
        scored = json.loads(raw)["choices"][0]["logprobs"]["token_logprobs"]
        assert scored[1:] == pytest.approx([rows[i - 1, ids[i]].item() for i in range(1, 48)], abs=TOLERANCE)
        for body in ({"prompt": ids + [5], "max_tokens": 0}, {"prompt": ids, "max_tokens": 1}):
            status, _, raw = http(url, "POST", "/v1/completions", {**body, "echo": True, "logprobs": 1})
            assert status == 400, raw


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_an_end_of_sequence_token_has_its_entry(client, tiny_smol, hf_smollm_tokenizer, api, stream):
    """lm-eval's scoring request (``echo``, ``logprobs: 1``, ``max_tokens: 1``) when the one
    generated token is EOS: it is reported (it adds no text), so ``token_logprobs[ctxlen:-1]``
    is the whole continuation. EOS is made the greedy choice by a ``logit_bias`` just past the
    top logit's, so its log-prob is far from 0 and the value is checked."""
    hf_model, eos = tiny_smol[1], hf_smollm_tokenizer.eos_token_id
    ids = hf_smollm_tokenizer(PROMPT)["input_ids"] if api == "completions" else chat_ids(hf_smollm_tokenizer)
    plain = torch_logprobs(hf_model, ids)
    bias = {eos: round(float(plain[-1].max() - plain[-1, eos]) + 0.5, 3)}
    expected = torch_logprobs(hf_model, ids, bias)[-1, eos].item()
    assert expected < -0.01  # a value to check, not a certainty
    body: dict[str, Any] = {"logit_bias": {str(eos): bias[eos]}, "max_tokens": 1}
    if api == "completions":
        body |= {"prompt": PROMPT, "echo": True, "logprobs": 1}
    text, entries, finish, usage, logprobs = generate(client, api, stream, **body)
    assert finish == "stop" and usage.completion_tokens == 1
    n = len(ids) if api == "completions" else 0
    assert entries[n:] == [(hf_smollm_tokenizer.convert_ids_to_tokens(eos), pytest.approx(expected, abs=TOLERANCE))]
    if api == "completions":
        assert text == PROMPT and len(entries) == n + 1  # EOS adds no text, but has its entry
        assert [lp for _, lp in entries[1:n]] == pytest.approx([plain[i - 1, ids[i]].item() for i in range(1, n)],
                                                               abs=TOLERANCE)  # the bias is for generating only
        assert len(logprobs["top_logprobs"][-1]) == 1 and logprobs["text_offset"][-1] == len(PROMPT)
    else:
        assert text == ""


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_a_stop_strings_tokens_have_entries(client, tiny_smol, hf_smollm_tokenizer, api, stream):
    """A stop string cut from the text still has its tokens reported: one entry per generated
    token (the last one wholly cut with the stop), each equal to transformers' greedy run."""
    hf_model = tiny_smol[1]
    ids = hf_smollm_tokenizer(PROMPT)["input_ids"] if api == "completions" else chat_ids(hf_smollm_tokenizer)
    reference = greedy_reference(hf_model, ids, 8)
    texts = [hf_smollm_tokenizer.decode([t for t, _ in reference[:k]]) for k in range(9)]
    # the stop: the k-th token's whole text, first found where that token starts (so the token
    # is wholly cut from the reply)
    k = next(k for k in range(3, 8) if texts[k].startswith(texts[k - 1]) and texts[k] != texts[k - 1]
             and texts[k].index(texts[k][len(texts[k - 1]):]) == len(texts[k - 1]))
    stop = texts[k][len(texts[k - 1]):]
    body = {"stop": [stop], "max_tokens": 8} | ({"prompt": PROMPT, "logprobs": 0} if api == "completions" else {})
    text, entries, finish, usage, _ = generate(client, api, stream, **body)
    assert finish == "stop" and text == texts[k - 1]
    assert len(entries) == k == usage.completion_tokens
    for (token, logprob), (expected_token, expected) in zip(entries, reference[:k]):
        assert token == (token_string(hf_smollm_tokenizer, expected_token) or token)
        assert logprob == pytest.approx(expected, abs=TOLERANCE)


# --- lm-evaluation-harness ----------------------------------------------------------------------

QUESTIONS = [
    {"question": "What is the capital of France?", "choices": [" Paris", " Berlin", " Madrid"], "answer": 0},
    {"question": "How many legs does a spider have?", "choices": [" six", " eight", " ten legs"], "answer": 1},
    {"question": "Which planet is known as the red planet?", "choices": [" Venus", " Jupiter", " Mars"], "answer": 2},
    {"question": "What do bees make?", "choices": [" honey", " milk", " silk"], "answer": 0},
]
DOCUMENTS = [
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"text": "Rain in Spain stays mainly in the plain; the café opens at nine, naïvely."},
    {"text": "def add(a, b):\n    return a + b\n"},
]


def write_tasks(directory: Path) -> None:
    """The three tasks as lm-eval YAML files over JSON lines files in ``directory`` (the
    ``datasets`` json builder: no hub)."""
    import yaml

    for name, rows in (("questions", QUESTIONS), ("documents", DOCUMENTS)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    def task(name: str, data: str, output_type: str, metric: str, aggregation: str, higher: bool, **fields: Any):
        config = {"task": name, "dataset_path": "json", "test_split": "test", "output_type": output_type,
                  "dataset_kwargs": {"data_files": {"test": str(directory / f"{data}.jsonl")}},
                  "metric_list": [{"metric": metric, "aggregation": aggregation, "higher_is_better": higher}],
                  "metadata": {"version": 1.0}, **fields}
        (directory / f"{name}.yaml").write_text(yaml.safe_dump(config))

    question = "Question: {{question}}\nAnswer:"
    task("mc_local", "questions", "multiple_choice", "acc", "mean", True, doc_to_text=question,
         doc_to_choice="{{choices}}", doc_to_target="{{answer}}")
    task("rolling_local", "documents", "loglikelihood_rolling", "word_perplexity", "weighted_perplexity", False,
         doc_to_text="", doc_to_target="{{text}}")
    task("gen_local", "questions", "generate_until", "exact_match", "mean", True, doc_to_text=question,
         doc_to_target="{{choices[answer]}}",
         generation_kwargs={"until": ["\n\n", "Question:"], "max_gen_toks": 12, "do_sample": False})


@pytest.fixture(scope="module")
def evaluate(tmp_path_factory):
    """``evaluate(model, model_args, tasks, chat)``: lm-eval's ``simple_evaluate`` on the local
    tasks (its task index holds them alone: indexing its 13k built-in YAML files costs ~50 s
    here); returns each task's raw responses, doc by doc."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    directory = tmp_path_factory.mktemp("lm_eval_tasks")
    write_tasks(directory)
    manager = TaskManager(include_path=str(directory), include_defaults=False)

    def run(model: str, model_args: dict[str, Any], tasks: list[str], chat: bool = False) -> dict[str, list[Any]]:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("HF_DATASETS_OFFLINE", "1")
            results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, task_manager=manager,
                                              apply_chat_template=chat, log_samples=True, bootstrap_iters=0)
        return {task: [s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]
                for task, samples in results["samples"].items()}

    return run


@pytest.fixture(scope="module")
def hf_results(evaluate, tiny_smol):
    """lm-eval's ``hf`` backend (transformers, torch CPU, float32) on the same directory: the
    three tasks, and the generation task through the chat template."""
    args = {"pretrained": str(tiny_smol[0]), "dtype": "float32", "device": "cpu", "batch_size": 1}
    return (evaluate("hf", args, ["mc_local", "rolling_local", "gen_local"]),
            evaluate("hf", args, ["gen_local"], chat=True))


def api_args(url: str, path: str, directory: Path, concurrent: int) -> dict[str, Any]:
    return {"base_url": url + path, "model": MODEL_NAME, "tokenizer": str(directory),
            "tokenizer_backend": "huggingface", "num_concurrent": concurrent, "max_retries": 1}


def leaves(value: Any) -> list[Any]:
    """The numbers, flags and strings of a nest of lists and tuples, in order."""
    return [leaf for item in value for leaf in leaves(item)] if isinstance(value, (list, tuple)) else [value]


def assert_same(ours: dict[str, list[Any]], reference: dict[str, list[Any]]) -> None:
    """Log-likelihoods within ``ITEM_TOLERANCE`` per item; greedy flags and strings identical."""
    assert ours.keys() == reference.keys()
    for task in reference:
        for mine, theirs in zip(leaves(ours[task]), leaves(reference[task]), strict=True):
            if isinstance(theirs, float):
                assert mine == pytest.approx(theirs, abs=ITEM_TOLERANCE, rel=0), task
            else:
                assert mine == theirs, task


def test_lm_eval_local_completions_equal_its_hf_backend(evaluate, server, hf_results, tiny_smol):
    reference, _ = hf_results
    tasks = ["mc_local", "rolling_local", "gen_local"]
    one = evaluate("local-completions", api_args(server, "/v1/completions", tiny_smol[0], 1), tasks)
    assert_same(one, reference)
    four = evaluate("local-completions", api_args(server, "/v1/completions", tiny_smol[0], 4), tasks)
    assert four == one  # concurrent requests share the engine's steps, bit for bit the same


def test_lm_eval_local_chat_completions_equal_its_hf_backend(evaluate, server, hf_results, tiny_smol):
    _, reference = hf_results
    ours = evaluate("local-chat-completions", api_args(server, "/v1/chat/completions", tiny_smol[0], 1),
                    ["gen_local"], chat=True)
    assert_same(ours, reference)
    assert any(text for text in leaves(ours["gen_local"]))  # something was generated
