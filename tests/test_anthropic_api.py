"""``POST /v1/messages`` driven by the official ``anthropic`` client: on the real SmolLM2, greedy
replies (whole and streamed through the SDK's stream helper) equal ``generate`` alone, a forced
tool call returns a ``tool_use`` block whose input follows the schema and a ``tool_result``
round trip continues the conversation; ``count_tokens`` equals transformers' count of the
template; x-api-key and Bearer auth; Anthropic-shaped errors; any model name unless restricted.
Thinking on a tiny random model with QwQ's template: the budget closes the thinking block."""

from __future__ import annotations

import json
from types import SimpleNamespace

import anthropic
import jsonschema
import pytest
from agent_support import template, tiny_chat_model
from server_support import http, load_for_engine, running_engine, running_server

KEY = "secret-key"
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"]}}
GREEDY = {"temperature": 0}  # the SDK no longer takes sampling arguments; the API still does
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm_gguf):
    model, tokenizer = load_for_engine(smollm_gguf)
    with running_engine(model, tokenizer, max_batch=4) as engine:
        with running_server(engine, model, tokenizer, api_key=KEY) as url:
            with running_server(engine, model, tokenizer, api_key=KEY, any_model_name=False) as strict:
                yield SimpleNamespace(url=url, strict=strict, model=model, tokenizer=tokenizer)


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)


def reference(server, messages, max_tokens):
    from mlxformer.generation.stream import stream_generate

    ids = server.tokenizer.encode(server.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    return "".join(r.text for r in stream_generate(server.model, server.tokenizer, ids, max_tokens)), len(ids)


def test_create_and_stream_equal_generate(server, client):
    system = "You are terse."
    expected, prompt_tokens = reference(server, [{"role": "system", "content": system}, *USER], 8)
    reply = client.messages.create(model="claude-local-a", max_tokens=8, extra_body=GREEDY, system=system, messages=USER)
    assert reply.type == "message" and reply.role == "assistant" and reply.model == "claude-local-a"
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == expected
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 8
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == prompt_tokens
    kinds = []
    with client.messages.stream(model="claude-local-b", max_tokens=8, extra_body=GREEDY,
                                system=[{"type": "text", "text": system}], messages=USER) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert final.content[0].text == expected and final.stop_reason == "max_tokens"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert kinds.index("content_block_start") < kinds.index("content_block_stop") < kinds.index("message_delta")


def test_tool_use_round_trip(client):
    forced = {"type": "tool", "name": "get_weather"}
    reply = client.messages.create(model="claude", max_tokens=40, extra_body=GREEDY, messages=USER, tools=[WEATHER],
                                   tool_choice=forced)
    assert reply.stop_reason == "tool_use"
    (call,) = [b for b in reply.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with client.messages.stream(model="claude", max_tokens=40, extra_body=GREEDY, messages=USER, tools=[WEATHER],
                                tool_choice=forced) as stream:
        deltas = [e.delta.partial_json for e in stream if e.type == "content_block_delta"
                  and e.delta.type == "input_json_delta"]
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert streamed.input == call.input and json.loads("".join(deltas)) == call.input and len(deltas) >= 1
    assert final.stop_reason == "tool_use"
    follow = client.messages.create(model="claude", max_tokens=6, extra_body=GREEDY, tools=[WEATHER], messages=[
        *USER, {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name,
                                                  "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"}]},
    ])
    assert follow.content and follow.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_count_tokens_equals_transformers(client, hf_smollm_tokenizer):
    system = "Answer in French."
    counted = client.messages.count_tokens(model="claude", system=system, messages=USER)
    text = hf_smollm_tokenizer.apply_chat_template([{"role": "system", "content": system}, *USER],
                                                   add_generation_prompt=True, tokenize=False)
    assert counted.input_tokens == len(hf_smollm_tokenizer(text, add_special_tokens=False)["input_ids"])


def test_auth_errors_and_model_names(server):
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0, timeout=300)
    assert bearer.messages.count_tokens(model="x", messages=USER).input_tokens > 0
    wrong = anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model="claude", max_tokens=4, messages=USER)
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "authentication_error"
    status, _, body = http(server.url, "POST", "/v1/messages", {"model": "claude", "messages": USER},
                           headers={"x-api-key": KEY})
    error = json.loads(body)
    assert status == 400 and error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in error["error"]["message"]
    strict = anthropic.Anthropic(base_url=server.strict, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as caught:
        strict.messages.create(model="claude-local-c", max_tokens=4, messages=USER)
    assert caught.value.body["error"]["type"] == "not_found_error"
    assert strict.messages.create(model="smollm2-test", max_tokens=2, messages=USER).usage.output_tokens == 2


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    model, tokenizer = tiny_chat_model(tmp_path_factory.mktemp("qwq"), template("Qwen-QwQ-32B"))
    with running_engine(model, tokenizer, max_batch=2) as engine:
        with running_server(engine, model, tokenizer) as url:
            yield anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300)


def test_thinking_budget_and_disabled(thinker):
    reply = thinker.messages.create(model="m", max_tokens=30, extra_body=GREEDY, messages=USER,
                                    thinking={"type": "enabled", "budget_tokens": 6})
    assert [b.type for b in reply.content] == ["thinking", "text"], reply.content
    assert 0 < len(reply.content[0].thinking.rstrip("\n")) <= 6  # 6 byte tokens, then "\n</think>" was forced
    with thinker.messages.stream(model="m", max_tokens=30, extra_body=GREEDY, messages=USER,
                                 thinking={"type": "enabled", "budget_tokens": 6}) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in reply.content]
    off = thinker.messages.create(model="m", max_tokens=10, extra_body=GREEDY, messages=USER, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]
