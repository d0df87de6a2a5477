"""`mlxformer serve`'s API driven by the official openai client (and raw HTTP for bad input), on
the real SmolLM2: greedy replies equal `generate` alone (also for 8 concurrent clients with
different settings, on a tiny random model over SmolLM2's tokenizer); stops, max tokens, seeds, usage and logprobs (against the model's own
log-softmax); OpenAI error bodies for bad input; API key and CORS policies; the chat page."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from server_support import MODEL_NAME, error_of, http, load_for_engine, running_server, served

MAX_TOKENS = 8
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def loaded(smollm_gguf):
    return load_for_engine(smollm_gguf)


@pytest.fixture(scope="module")
def server(loaded):
    model, tokenizer = loaded
    with served(model, tokenizer, max_batch=8) as server:
        yield server


@pytest.fixture(scope="module")
def tiny_server(tiny_smol):
    """The same server over conftest's tiny llama with SmolLM2's tokenizer and chat template:
    for checks of batching, where real text adds nothing but ~0.2 s per token."""
    from mlxformer import load

    model, tokenizer = load(tiny_smol[0], threads=1)
    with served(model, tokenizer, max_batch=8) as server:
        yield server


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture
def client(server):
    return openai_client(server)


def reference(server, ids: list[int], max_tokens: int = MAX_TOKENS, **kwargs) -> tuple[str, list[int], str]:
    """`generate` alone on ``ids``: (text, token ids, finish reason)."""
    from mlxformer.generation.stream import stream_generate

    responses = list(stream_generate(server.model, server.tokenizer, ids, max_tokens, **kwargs))
    return "".join(r.text for r in responses), [r.token for r in responses], responses[-1].finish_reason


def chat_ids(server, prompt: str, system: str | None = None) -> list[int]:
    return server.tokenizer.encode_prompt(prompt, system)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    status, _, body = http(server.url, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_chat_streamed_and_not_equal_generate(server, client, hf_smollm_tokenizer):
    expected, tokens, finish = reference(server, chat_ids(server, QUESTION))
    messages = [{"role": "user", "content": QUESTION}]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == finish
    # Usage: the prompt as transformers' own tokenizer renders it; every generated token.
    hf_ids = hf_smollm_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    hf_ids = hf_ids if isinstance(hf_ids, list) else hf_ids["input_ids"]
    assert reply.usage.prompt_tokens == len(hf_ids)
    assert reply.usage.completion_tokens == len(tokens)
    assert reply.usage.total_tokens == len(hf_ids) + len(tokens)

    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
        max_completion_tokens=MAX_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True},
    ))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == expected
    assert sum(1 for p in pieces if p) > 1  # it streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [finish]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)


def test_completions_max_tokens_and_stop(server, client):
    prompt = "The capital of France is"
    expected, tokens, _ = reference(server, server.tokenizer.encode(prompt), 6)
    reply = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0)
    assert reply.choices[0].text == expected and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 6 == len(tokens)
    assert reply.usage.prompt_tokens == len(server.tokenizer.encode(prompt))

    words = expected.split()
    assert len(words) >= 2, expected
    stop = words[1]
    cut = expected[: expected.index(stop)]  # Python's own view of where the stop string starts
    streamed = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0, stop=[stop, "@@never@@"], stream=True,
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducibility(client):
    def sample(seed: int) -> str:
        reply = client.completions.create(
            model=MODEL_NAME, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=seed,
        )
        return reply.choices[0].text

    first = sample(11)
    assert sample(11) == first
    assert len({first, sample(12), sample(13)}) > 1  # the seed matters


def log_softmax_rows(server, ids: list[int], generated: list[int]):
    """Our model's log-softmax over the prompt plus the generated tokens: row i scores generated[i]."""
    import mlx.core as mx

    logits = server.model(mx.array([ids + generated[:-1]]))[0, len(ids) - 1:].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def test_logprobs_match_the_model(server, client):
    import mlx.core as mx

    ids = chat_ids(server, QUESTION)
    _, tokens, _ = reference(server, ids, 5)
    scored = tokens  # every generated token has its entry (test_server_eval: EOS and a stop's tokens too)
    rows = log_softmax_rows(server, ids, tokens)
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": QUESTION}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=3,
    )
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == [server.tokenizer.decode([t]) for t in scored]
    for i, (entry, token) in enumerate(zip(content, scored)):
        assert entry.logprob == pytest.approx(rows[i, token].item(), abs=2e-3)
        top = mx.argsort(-rows[i])[:3].tolist()
        assert [t.token for t in entry.top_logprobs][:1] == [server.tokenizer.decode([top[0]])]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([rows[i, j].item() for j in top], abs=2e-3)

    prompt = "The capital of France is"
    prompt_ids = server.tokenizer.encode(prompt)
    _, tokens, _ = reference(server, prompt_ids, 3)
    rows = log_softmax_rows(server, prompt_ids, tokens)
    reply = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx([rows[i, t].item() for i, t in enumerate(tokens)], abs=2e-3)
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == reply.choices[0].text


STOP_INSIDE_REPLY = "stop inside the reply"  # replaced by two characters from the middle of the reply alone
CLIENTS = [  # (kind, prompt, settings): different prompts, lengths, stops and options
    ("chat", QUESTION, dict(max_tokens=8)),
    ("chat", "Name three colors.", dict(max_tokens=10, stream=True)),
    ("chat", "Write a haiku about the sea.", dict(max_tokens=6, system="You are a poet.")),
    ("completion", "The quick brown fox", dict(max_tokens=9)),
    ("completion", "1, 2, 3, 4,", dict(max_tokens=10, stop=STOP_INSIDE_REPLY, stream=True)),
    ("chat", "What is 2 + 2?", dict(max_tokens=7, logprobs=True)),
    ("chat", "Tell me a fun fact about cats.", dict(max_tokens=8, repetition_penalty=1.3)),
    ("completion", "def fibonacci(n):", dict(max_tokens=8)),
]


def run_client(client, kind: str, prompt: str, settings: dict) -> str:
    settings = dict(settings)
    system = settings.pop("system", None)
    stream = settings.pop("stream", False)
    extra = {"repetition_penalty": settings.pop("repetition_penalty")} if "repetition_penalty" in settings else {}
    if kind == "chat":
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, temperature=0, stream=stream, extra_body=extra, **settings
        )
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
        return reply.choices[0].message.content
    reply = client.completions.create(
        model=MODEL_NAME, prompt=prompt, temperature=0, stream=stream, extra_body=extra, **settings
    )
    if stream:
        return "".join(c.choices[0].text for c in reply if c.choices)
    return reply.choices[0].text


def test_eight_concurrent_clients_equal_generate_alone(tiny_server):
    """On the tiny model (batching is what is checked; SmolLM2's eight references and replies
    cost ~120 s here). The stop string is cut from the middle of that client's reply alone, so
    it fires inside the batch."""
    from mlxformer.generation.stream import SamplingSettings

    server, clients, expected = tiny_server, [], []
    for kind, prompt, settings in CLIENTS:
        ids = chat_ids(server, prompt, settings.get("system")) if kind == "chat" else server.tokenizer.encode(prompt)
        sampling = SamplingSettings(repetition_penalty=settings.get("repetition_penalty"))
        if settings.get("stop") == STOP_INSIDE_REPLY:
            whole, _, _ = reference(server, ids, settings["max_tokens"], sampling=sampling)
            middle = len(whole) // 2
            settings = {**settings, "stop": [whole[middle : middle + 2]]}
        text, _, finish = reference(server, ids, settings["max_tokens"], stop=settings.get("stop", ()), sampling=sampling)
        assert "stop" not in settings or (finish == "stop" and len(text) <= middle), (text, settings)
        clients.append((kind, prompt, settings))
        expected.append(text)
    client = openai_client(server)
    with ThreadPoolExecutor(len(clients)) as pool:
        replies = list(pool.map(lambda c: run_client(client, *c), clients))
    assert replies == expected


BAD_REQUESTS = [  # (body, expected status, expected param or None)
    (b'{"messages": [', 400, None),  # malformed JSON
    (b"[1, 2]", 400, None),  # not an object
    ({"messages": "hello"}, 400, "messages"),  # wrong type
    ({"messages": []}, 400, "messages"),  # empty
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, None),  # unknown role
    ({"messages": [{"role": "user"}]}, 400, "messages"),  # a user turn without content
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400, "top_logprobs"),  # without logprobs
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_k": 2**31}, 400, "top_k"),  # past the graph's int32
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 99, "logprobs": True}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
]


@pytest.mark.parametrize("body,status,param", BAD_REQUESTS)
def test_bad_chat_requests_get_openai_errors(server, body, status, param):
    got, headers, raw = http(
        server.url, "POST", "/v1/chat/completions", body if isinstance(body, dict) else body,
        headers=None if isinstance(body, dict) else {"Content-Type": "application/json"},
    )
    assert got == status, raw
    assert headers["content-type"].startswith("application/json")
    error = error_of(raw)
    if param is not None:
        assert error["param"] == param


def test_more_bad_input_then_still_serving(server, client):
    long_prompt = "hello " * 9000  # more tokens than SmolLM2's 8192-token context
    status, _, raw = http(server.url, "POST", "/v1/completions", {"prompt": long_prompt, "max_tokens": 1})
    assert status == 400 and error_of(raw)["code"] == "context_length_exceeded"
    status, _, raw = http(server.url, "POST", "/v1/completions", {"prompt": [10**9], "max_tokens": 1})
    assert status == 400 and error_of(raw)["param"] == "prompt"
    status, _, raw = http(server.url, "POST", "/v1/completions", b'{"prompt": "x"}', {"Content-Type": "text/plain"})
    assert status == 415 and error_of(raw)
    status, _, raw = http(server.url, "GET", "/v1/nothing-here")
    assert status == 404 and error_of(raw)
    status, _, raw = http(server.url, "GET", "/v1/chat/completions")
    assert status == 405 and error_of(raw)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], n=3)
    assert "n > 1" in caught.value.message
    reply = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens >= 1


def test_response_format_json_schema(server, client):
    import jsonschema

    schema = {
        "type": "object", "properties": {"capital": {"type": "string", "maxLength": 24}},
        "required": ["capital"], "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": QUESTION + " Answer in JSON."}], max_tokens=40,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    content = reply.choices[0].message.content
    jsonschema.validate(json.loads(content), schema)
    assert reply.choices[0].finish_reason == "stop"
    # a stop string inside the JSON cuts it short: reported as a length cut, streamed or not (issue 17, 4)
    cut = content[content.index('"', content.index(":")) + 1:][:3]
    for stream in (False, True):
        again = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": QUESTION + " Answer in JSON."}], max_tokens=40,
            temperature=0, stop=[cut], stream=stream,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        )
        chunks = list(again) if stream else [again]
        text = "".join((c.choices[0].delta.content or "") if stream else c.choices[0].message.content for c in chunks)
        assert text == content[: content.index(cut)] and chunks[-1].choices[0].finish_reason == "length", stream
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    body = {"messages": [{"role": "user", "content": "Hi"}], "response_format": bad}
    status, _, raw = http(server.url, "POST", "/v1/chat/completions", body)
    assert status == 400 and error_of(raw)["param"] == "response_format"


def test_cors_is_off_by_default_and_on_when_asked(server, loaded):
    origin = {"Origin": "http://elsewhere.example"}
    preflight = {**origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    _, headers, _ = http(server.url, "GET", "/v1/models", headers=origin)
    assert "access-control-allow-origin" not in headers
    status, headers, _ = http(server.url, "OPTIONS", "/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in headers and status >= 400
    model, tokenizer = loaded
    with running_server(server.engine, model, tokenizer, cors_origins=["http://elsewhere.example"]) as url:
        status, headers, _ = http(url, "OPTIONS", "/v1/chat/completions", headers=preflight)
        assert status == 200 and headers["access-control-allow-origin"] == "http://elsewhere.example"
        _, headers, _ = http(url, "GET", "/v1/models", headers={"Origin": "http://other.example"})
        assert "access-control-allow-origin" not in headers


def test_api_key(server, loaded):
    model, tokenizer = loaded
    with running_server(server.engine, model, tokenizer, api_key="s3cret") as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, _, raw = http(url, "GET", "/v1/models", headers=headers)
            assert status == 401 and error_of(raw)["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        keyed = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0, timeout=300)
        assert keyed.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=1).usage.completion_tokens == 1
        assert http(url, "GET", "/health")[0] == 200


def test_chat_page_is_served_self_contained(server):
    status, headers, raw = http(server.url, "GET", "/")
    html = raw.decode()
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in headers["content-security-policy"]
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)  # nothing from a CDN
    assert "/v1/chat/completions" in html
