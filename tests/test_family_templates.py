"""The chat templates of the 2026 families (llama.cpp's copies in ``models/templates/``), each on
a tiny random model with a byte-level tokenizer, served: a forced tool call (tool_choice
required) through the three APIs — Chat Completions, Responses (the official ``openai``
client) and Messages (``anthropic``) — is rendered in the family's own format and parsed back
to a call of the offered function with arguments valid for its schema. Also each template's
own assistant turns (reasoning, text, calls) split back into reasoning, content and calls."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
from agent_support import rendered_reply, template, tiny_chat_model
from server_support import MODEL_NAME, served

from mlxformer.server.reasoning import GEMMA4_THINK, MISTRAL_THINK, ThinkSplitter, think_tags
from mlxformer.server.toolcalls import ToolCallStream, ToolSpec, call_format, format_for_template

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "metric": {"type": "boolean"}}, "required": ["city", "metric"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": SCHEMA}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
# (llama.cpp template, the call format its markers select, its reasoning tags)
TEMPLATES = [("mistralai-Ministral-3-14B-Reasoning-2512", "mistral_v11", MISTRAL_THINK),
             ("google-gemma-4-31B-it", "gemma4", GEMMA4_THINK)]
# Gemma 4's arguments, in its own notation (strings between <|"|>, bare keys, nested values)
ARGUMENTS = [{"city": 'Paris, "FR"', "days": 3, "opts": {"metric": True, "unit": "C"}, "tags": ["a", "b"]},
             {"city": "Lyon"}]


@pytest.mark.parametrize("name,fmt,tags", TEMPLATES, ids=[t[0] for t in TEMPLATES])
def test_template_turn_splits_into_reasoning_content_and_calls(name, fmt, tags):
    """The template's own rendering of a turn with reasoning, text and two calls, fed whole and
    one character at a time."""
    source = template(name)
    assert format_for_template(source) == fmt
    calls = [{"id": f"abcdefgh{i}", "type": "function", "function": {"name": "get_weather", "arguments": a}}
             for i, a in enumerate(ARGUMENTS)]
    if fmt == "gemma4":  # reasoning as a message field, rendered as the thought channel
        reply = {"role": "assistant", "content": "Checking.", "reasoning_content": "The user wants the weather.",
                 "tool_calls": calls}
    else:
        reply = {"role": "assistant", "tool_calls": calls, "content": [
            {"type": "thinking", "thinking": "The user wants the weather."}, {"type": "text", "text": "Checking."}]}
    text = rendered_reply(source, USER, reply, tools=[TOOL], enable_thinking=True).split("<|tool_response>")[0]
    assert text.startswith(tags.open)
    for pieces in ([text], list(text)):
        splitter = ThinkSplitter(False, tags)
        stream = ToolCallStream(call_format(fmt), ToolSpec({"get_weather": SCHEMA}))
        reasoning, answer = "", ""
        for piece in [*pieces, None]:
            split = splitter.feed(piece or "", final=piece is None)
            reasoning += split.reasoning
            answer += stream.feed(split.content).content
        answer += stream.finish().content
        assert reasoning.strip() == "The user wants the weather." and answer == "Checking.", text
        assert [(c.name, json.loads(c.arguments)) for c in stream.calls] == [("get_weather", a) for a in ARGUMENTS]


@pytest.fixture(scope="module", params=TEMPLATES, ids=[t[0] for t in TEMPLATES])
def server(request, tmp_path_factory):
    name, fmt, tags = request.param
    model, tokenizer = tiny_chat_model(tmp_path_factory.mktemp("family_template"), template(name))
    assert think_tags(tokenizer) == tags
    with served(model, tokenizer, max_batch=2) as server:
        server.fmt = fmt
        yield server


def test_forced_call_through_three_apis(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=[TOOL], tool_choice="required",
                                          max_tokens=300, temperature=0)
    (call,) = chat.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and chat.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    if server.fmt.startswith("mistral"):
        assert len(call.id) == 9 and call.id.isalnum()  # what Mistral's templates accept

    responses = client.responses.create(model=MODEL_NAME, input=USER[0]["content"], tool_choice="required",
                                        tools=[{"type": "function", "name": "get_weather", "parameters": SCHEMA}],
                                        max_output_tokens=300, temperature=0)
    (item,) = [o for o in responses.output if o.type == "function_call"]
    assert item.name == "get_weather" and responses.status == "completed"
    jsonschema.validate(json.loads(item.arguments), SCHEMA)

    messages = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    reply = messages.messages.create(model=MODEL_NAME, max_tokens=300, messages=USER, tool_choice={"type": "any"},
                                     tools=[{"name": "get_weather", "description": "Weather of a city",
                                             "input_schema": SCHEMA}], extra_body={"temperature": 0})
    (use,) = [b for b in reply.content if b.type == "tool_use"]
    assert use.name == "get_weather" and reply.stop_reason == "tool_use"
    jsonschema.validate(use.input, SCHEMA)
