"""The Responses API and the agent clients, on the real SmolLM2 through one server: the official
``openai`` client's ``responses.create`` and its stream helper (greedy text equals ``generate``
alone; the documented event sequence with sequence numbers), a forced function call and its
``function_call_output`` round trip (stateless and by ``previous_response_id``), json_schema
output; the OpenAI Agents SDK's default Responses model running a function-tool loop (model call,
tool run, its output as the final answer); instructor's JSON_SCHEMA and TOOLS modes extracting a pydantic object; streamed
chat ``tool_calls`` deltas as the openai client assembles them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import openai
import pytest
from pydantic import BaseModel
from server_support import MODEL_NAME, load_for_engine, running_engine, running_server

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": WEATHER_SCHEMA}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(smollm_gguf):
    model, tokenizer = load_for_engine(smollm_gguf)
    with running_engine(model, tokenizer, max_batch=4) as engine:
        with running_server(engine, model, tokenizer) as url:
            yield SimpleNamespace(url=url, model=model, tokenizer=tokenizer)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_responses_create_and_stream(server, client):
    from mlxformer.generation.stream import stream_generate

    ids = server.tokenizer.encode_prompt(QUESTION, "Be brief.")
    expected = "".join(r.text for r in stream_generate(server.model, server.tokenizer, ids, 8))
    reply = client.responses.create(model="gpt-4.1", instructions="Be brief.", input=QUESTION, max_output_tokens=8,
                                    temperature=0)
    assert reply.output_text == expected and reply.status == "incomplete"
    assert reply.incomplete_details.reason == "max_output_tokens" and reply.usage.output_tokens == 8
    assert reply.usage.input_tokens == len(ids) and reply.output[0].type == "message"
    assert float(reply.created_at).is_integer()  # whole seconds, as OpenAI sends them
    events = list(client.responses.create(model="gpt-4.1", instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}], max_output_tokens=8, temperature=0,
        stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # cut by max_output_tokens (completed: test_function_call_round_trip)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    assert events[-1].response.output_text == expected and events[-1].response.usage.output_tokens == 8
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_function_call_round_trip(client):
    first = client.responses.create(model=MODEL_NAME, input=QUESTION, tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=40, temperature=0)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    with client.responses.stream(model=MODEL_NAME, input=QUESTION, tools=[WEATHER], tool_choice="required",
                                 max_output_tokens=40, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    (streamed,) = [item for item in final.output if item.type == "function_call"]
    assert streamed.arguments == call.arguments == "".join(deltas)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}
    stateless = client.responses.create(model=MODEL_NAME, tools=[WEATHER], max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}, result])
    chained = client.responses.create(model=MODEL_NAME, tools=[WEATHER], max_output_tokens=6, temperature=0,
                                      previous_response_id=first.id, input=[result])
    assert chained.usage.input_tokens == stateless.usage.input_tokens  # the same conversation
    assert chained.output_text == stateless.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL_NAME, input="hi", previous_response_id="resp_unknown")


def test_json_schema_output_is_closed(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 99999999}}, "required": ["city", "population"]}
    reply = client.responses.create(model=MODEL_NAME, input="The largest city in France, as JSON.", temperature=0,
                                    max_output_tokens=60,
                                    text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    assert reply.status == "completed", reply.output_text
    value = json.loads(reply.output_text)
    jsonschema.validate(value, {**schema, "additionalProperties": False})  # no keys beyond the schema's


def test_agents_sdk_function_tool_loop(server):
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "18 C and sunny"

    model = OpenAIResponsesModel(model="gpt-4.1", openai_client=openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300))
    agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather], model=model,
                  model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=24),
                  tool_use_behavior="stop_on_first_tool")  # SmolLM2 (135M) would keep calling when left to choose
    result = Runner.run_sync(agent, QUESTION, max_turns=3)
    assert calls and calls[0] and result.final_output == "18 C and sunny"
    assert [item.type for item in result.new_items] == ["tool_call_item", "tool_call_output_item"]


class City(BaseModel):
    name: str
    country: str


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor_extracts(client, mode):
    import instructor

    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    city = patched.chat.completions.create(model=MODEL_NAME, response_model=City, max_retries=0, temperature=0,
                                           max_tokens=60, messages=[{"role": "user", "content": "Paris is in France."}])
    assert isinstance(city, City) and city.name and city.country


def test_chat_tool_call_deltas(client):
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": QUESTION}], max_tokens=40, temperature=0, stream=True,
        tools=[{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}],
        tool_choice="required"))
    deltas = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    assert all(d.id is None and d.function.name is None and d.index == 0 for d in deltas[1:])
    jsonschema.validate(json.loads("".join(d.function.arguments for d in deltas)), WEATHER_SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_model_metadata_and_template_tools(server, client, smollm_gguf, hf_smollm_tokenizer):
    from gguf import GGUFReader
    from server_support import http

    field = GGUFReader(str(smollm_gguf)).fields["llama.context_length"]
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.context_length == int(field.parts[field.data[0]][0])
    assert card.capabilities == {"chat": True, "tools": True, "tool_parser": "json", "reasoning": False,
                                 "structured_output": True}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("another-model")
    text = "Hello, world! Ünïcode."
    status, _, body = http(server.url, "POST", "/tokenize", {"content": text})
    ids = json.loads(body)["tokens"]
    assert status == 200 and ids == hf_smollm_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert json.loads(http(server.url, "POST", "/detokenize", {"tokens": ids})[2])["content"] == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    prompt = json.loads(http(server.url, "POST", "/apply-template", {"messages": messages})[2])["prompt"]
    assert prompt == hf_smollm_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert http(server.url, "POST", "/detokenize", {"tokens": [10**9]})[0] == 400
