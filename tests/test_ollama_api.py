"""Ollama's API (``/api/*``) driven by the official ``ollama`` Python client on the real
SmolLM2: greedy chat and generate replies (whole and streamed) equal ``generate`` alone on the
template's (or the raw prompt's) tokens, with Ollama's counts and done reasons; a tool round
trip reaches the template as OpenAI-shaped messages do (transformers' rendering of the same
conversation); ``format`` as a JSON Schema yields JSON valid against it (jsonschema);
``list``/``show``/``ps`` describe the served GGUF; errors are Ollama's ``{"error": ...}``."""

from __future__ import annotations

import json

import jsonschema
import ollama
import pytest
from server_support import http, load_for_engine, running_engine, running_server

GREEDY = {"temperature": 0}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(smollm_gguf):
    from types import SimpleNamespace

    from mlxformer.server.registry import SingleHost

    model, tokenizer = load_for_engine(smollm_gguf)
    with running_engine(model, tokenizer, max_batch=2) as engine:
        with running_server(engine, model, tokenizer, host=lambda ctx: SingleHost(ctx, str(smollm_gguf))) as url:
            yield SimpleNamespace(url=url, model=model, tokenizer=tokenizer, client=ollama.Client(host=url, timeout=300))


def reference(server, ids: list[int], max_tokens: int) -> str:
    from mlxformer.generation.stream import stream_generate

    return "".join(r.text for r in stream_generate(server.model, server.tokenizer, ids, max_tokens))


def template_ids(server, messages, **kwargs) -> list[int]:
    text = server.tokenizer.apply_chat_template(messages, **kwargs)
    return server.tokenizer.encode(text, add_special_tokens=False)


def test_chat_whole_and_streamed_equal_generate(server):
    ids = template_ids(server, USER)
    expected = reference(server, ids, 8)
    reply = server.client.chat(model="anything:latest", messages=USER, options={**GREEDY, "num_predict": 8})
    assert reply.message.role == "assistant" and reply.message.content == expected
    assert (reply.done, reply.done_reason, reply.eval_count, reply.prompt_eval_count) == (True, "length", 8, len(ids))
    # the durations split at the first token, whole or streamed (a whole reply's prompt time was 0)
    assert reply.prompt_eval_duration > 0 and reply.eval_duration > 0
    assert reply.load_duration + reply.prompt_eval_duration + reply.eval_duration <= reply.total_duration
    parts = list(server.client.chat(model="anything", messages=USER, options={**GREEDY, "num_predict": 8}, stream=True))
    assert "".join(p.message.content for p in parts) == expected
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].done_reason == "length" and parts[-1].eval_count == 8 and parts[-1].total_duration > 0


def test_generate_templated_and_raw_equal_generate(server):
    prompt = "Once upon a time"
    templated = server.client.generate(model="m", prompt=prompt, options={**GREEDY, "num_predict": 6})
    assert templated.response == reference(server, template_ids(server, [{"role": "user", "content": prompt}]), 6)
    raw_ids = server.tokenizer.encode(prompt)
    streamed = list(server.client.generate(model="m", prompt=prompt, raw=True, stream=True,
                                           options={**GREEDY, "num_predict": 6}))
    assert "".join(p.response for p in streamed) == reference(server, raw_ids, 6)
    assert streamed[-1].prompt_eval_count == len(raw_ids)
    loaded = server.client.generate(model="m", prompt="")
    assert loaded.done and loaded.done_reason == "load"


def test_tool_round_trip_is_the_chat_completions_turn(server):
    """The same conversation through Chat Completions (OpenAI-shaped, checked against transformers
    and the openai client in test_server_tools) gives the same prompt and reply."""
    calls = [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    messages = [*USER, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "content": "18 C and sunny", "tool_name": "get_weather"}]
    reply = server.client.chat(model="m", messages=messages, tools=[WEATHER], options={**GREEDY, "num_predict": 10})
    openai_shaped = [*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "18 C and sunny", "tool_call_id": "call_1"}]
    status, _, body = http(server.url, "POST", "/v1/chat/completions", {
        "model": "smollm2-test", "messages": openai_shaped, "tools": [WEATHER], "temperature": 0, "max_tokens": 10})
    assert status == 200, body
    expected = json.loads(body)
    assert reply.prompt_eval_count == expected["usage"]["prompt_tokens"]
    assert reply.message.content == expected["choices"][0]["message"]["content"]


def test_format_schema_gives_valid_json(server):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "sunny": {"type": "boolean"}}, "required": ["city", "sunny"]}
    reply = server.client.chat(model="m", messages=USER, format=schema, options={**GREEDY, "num_predict": 60})
    jsonschema.validate(json.loads(reply.message.content), schema)
    plain = server.client.generate(model="m", prompt="Name a city.", format="json", options={**GREEDY, "num_predict": 12})
    free = server.client.generate(model="m", prompt="Name a city.", options={**GREEDY, "num_predict": 12})
    assert plain.response.lstrip().startswith("{") and not free.response.lstrip().startswith("{")


def test_list_show_ps_describe_the_served_model(server, smollm_gguf):
    listed = server.client.list().models
    assert len(listed) == 1 and listed[0].size == smollm_gguf.stat().st_size
    assert (listed[0].details.format, listed[0].details.family, listed[0].details.quantization_level) == (
        "gguf", "llama", "Q4_1")
    shown = server.client.show("m")
    assert shown.template == server.tokenizer.chat_template and "completion" in shown.capabilities
    assert shown.modelinfo["llama.context_length"] == server.model.args.max_position_embeddings
    running = server.client.ps().models
    assert [m.context_length for m in running] == [server.model.args.max_position_embeddings]
    assert server.client._client.get("/api/version").json()["version"]


def test_errors_are_ollama_shaped(server):
    with pytest.raises(ollama.ResponseError) as error:
        server.client.embed(model="m", input=[])
    assert error.value.status_code == 400 and "must not be empty" in error.value.error
    with pytest.raises(ollama.ResponseError) as error:
        server.client.chat(model="m", messages=USER, options={"temperature": -1})
    assert error.value.status_code == 400 and "temperature" in error.value.error
    status, _, body = http(server.url, "POST", "/api/chat", {"model": "m", "messages": USER, "keep_alive": "soon"})
    assert status == 400 and json.loads(body) == {
        "error": "keep_alive must be seconds or a duration like \"5m\" (got 'soon')"}
    status, _, body = http(server.url, "POST", "/api/pull", {"model": "not a repo"})
    assert status == 400 and set(json.loads(body)) == {"error"}
    # wrong types are 400s, as Ollama's Go decoder answers them (no "no" or 0 for false)
    for wrong in ({"stream": "no"}, {"stream": 0}, {"keep_alive": True}, {"raw": "yes"}):
        status, _, body = http(server.url, "POST", "/api/generate", {"model": "m", "prompt": "Hi", **wrong})
        assert status == 400 and set(json.loads(body)) == {"error"}, wrong
    # SmolLM2 does not reason: thinking is Ollama's 400 ("think": false is fine)
    with pytest.raises(ollama.ResponseError) as error:
        server.client.chat(model="smol", messages=USER, think=True)
    assert error.value.status_code == 400 and error.value.error == '"smol" does not support thinking'
    reply = server.client.generate(model="m", prompt="Hi", think=False, options={**GREEDY, "num_predict": 2})
    assert reply.done


def test_a_model_without_a_chat_template_points_to_each_apis_plain_route(server):
    """Chat needs a template; the 400 names the route of the same API that takes plain text,
    and that route answers."""
    template, server.tokenizer.chat_template = server.tokenizer.chat_template, None
    try:
        with pytest.raises(ollama.ResponseError) as error:
            server.client.chat(model="m", messages=USER, options={"num_predict": 1})
        assert error.value.status_code == 400 and error.value.error.endswith("use /api/generate")
        assert server.client.generate(model="m", prompt="Once upon a time", options={"num_predict": 2}).done
        status, _, body = http(server.url, "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 1})
        assert status == 400 and json.loads(body)["error"]["message"].endswith("use /v1/completions")
    finally:
        server.tokenizer.chat_template = template


def test_ollamas_curl_examples_work_without_a_json_content_type(server):
    """Ollama's README runs ``curl URL/api/generate -d '{...}'``: curl declares the body
    form-encoded (or, with ``-H 'Content-Type:'``, not at all); Ollama reads it as JSON, so do we.
    A browser page (an ``Origin`` header) must still declare JSON (415)."""
    import subprocess

    body = {"model": "m", "prompt": "Once upon a time", "stream": False, "options": {**GREEDY, "num_predict": 6}}
    expected = server.client.generate(**{k: v for k, v in body.items() if k != "stream"}).response
    for extra in ([], ["-H", "Content-Type:"]):
        out = subprocess.run(["curl", "-s", "--max-time", "120", f"{server.url}/api/generate", *extra,
                              "-d", json.dumps(body)], capture_output=True, text=True, timeout=150)
        assert json.loads(out.stdout)["response"] == expected, out.stdout
    chat = {"model": "m", "messages": USER, "stream": False, "options": {**GREEDY, "num_predict": 4}}
    status, _, reply = http(server.url, "POST", "/api/chat", json.dumps(chat).encode(),
                            {"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 200 and json.loads(reply)["message"]["content"]
    status, _, reply = http(server.url, "POST", "/api/chat", json.dumps(chat).encode(),
                            {"Content-Type": "text/plain", "Origin": "http://evil.example"})
    assert status == 415 and set(json.loads(reply)) == {"error"}
