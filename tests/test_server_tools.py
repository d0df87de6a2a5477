"""Tool calling through `mlxformer serve` with the official openai client, on the real SmolLM2:
a forced call (named or ``required``, whole or streamed) returns ``tool_calls`` whose arguments
validate against the function's parameter schema (``jsonschema``); bad tools are 400s."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import openai
import pytest
from server_support import MODEL_NAME, error_of, http, load_for_engine, running_engine, running_server

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a time zone",
                                      "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                     "pattern": "^[A-Z]{3}$"}}, "required": ["zone"]}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm_gguf):
    model, tokenizer = load_for_engine(smollm_gguf)
    with running_engine(model, tokenizer, max_batch=4) as engine:
        with running_server(engine, model, tokenizer) as url:
            yield SimpleNamespace(url=url)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _check_call(name: str, arguments: str, allowed: set[str]) -> None:
    assert name in allowed
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])


def test_forced_named_call(client):
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=48, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    _check_call(call.function.name, call.function.arguments, {"get_weather"})


def test_required_call_streamed(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=48, temperature=0,
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            assert not choice.delta.content  # a forced call sends no text
    assert finish == "tool_calls" and len(calls) == 1
    _check_call(calls[0]["name"], calls[0]["arguments"], set(PARAMETERS))


def test_auto_and_none(client):
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=48,
                                           temperature=0)
    message = reply.choices[0].message
    if message.tool_calls:  # the model chose to call: the call is well-formed
        assert reply.choices[0].finish_reason == "tool_calls"
        for call in message.tool_calls:
            assert call.function.name in PARAMETERS and isinstance(json.loads(call.function.arguments), dict)
    else:
        assert isinstance(message.content, str) and reply.choices[0].finish_reason in ("stop", "length")
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, temperature=0)
    assert reply.choices[0].message.tool_calls is None and isinstance(reply.choices[0].message.content, str)


def test_conversation_with_a_tool_result(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, temperature=0)
    assert isinstance(reply.choices[0].message.content, str)


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tools_are_400(server, extra, param):
    status, _, raw = http(server.url, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **extra})
    assert status == 400 and error_of(raw)["param"] == param, raw
