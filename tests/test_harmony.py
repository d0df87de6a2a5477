"""Harmony (gpt-oss): the chat template llama.cpp ships (``models/templates/openai-gpt-oss-120b.jinja``
of the llama-cpp-python sdist, read by ``agent_support.template``) rendered by our sandboxed
jinja against the format's known output (OpenAI's Harmony guide: system message with the
``Reasoning:`` level, developer message with the TypeScript-like ``functions`` namespace,
past calls with their analysis kept only before a call); the Harmony parser on hand-written
replies and the template's own, split at every point (streamed = whole, no control token in
content); and through the three APIs with the official ``openai`` and ``anthropic`` clients on
a tiny random gpt-oss with a Harmony tokenizer (the control tokens as special tokens), where
a forced call (the grammar) parses back to a valid call on each.

(``openai-harmony``, OpenAI's reference, is compared with in test_harmony_reference.py, offline.)
"""

from __future__ import annotations

import datetime
import json

import pytest
from agent_support import render, rendered_reply, template
from server_support import MODEL_NAME

from mlxformer.server.toolcalls import ToolSpec, call_format, format_for_template, reply_stream

SOURCE = "openai-gpt-oss-120b"
PARAMETERS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"},
                                                     "unit": {"type": "string", "enum": ["c", "f"]}},
                    "required": ["city"]},
    "get_time": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
}
TOOLS = [{"type": "function", "function": {"name": n, "description": f"Gets the {n[4:]}.", "parameters": p}}
         for n, p in PARAMETERS.items()]
SPEC = ToolSpec(PARAMETERS)
CONTROL = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")


def test_template_renders_the_known_harmony_prompt():
    messages = [
        {"role": "system", "content": "Answer in riddles."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "thinking": "I need the weather tool.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "{\"temp\": 20}"},
        {"role": "assistant", "content": "Warm as a summer riddle.", "thinking": "dropped in past turns"},
        {"role": "user", "content": "And now?"},
    ]
    today = datetime.date.today().strftime("%Y-%m-%d")
    expected = (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: {today}\n\nReasoning: high\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
        "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nAnswer in riddles.\n\n# Tools\n\n## functions\n\n"
        "namespace functions {\n\n// Gets the weather.\ntype get_weather = (_: {\n// The city\ncity: string,\n"
        'unit?: "c" | "f",\n}) => any;\n\n// Gets the time.\ntype get_time = (_: {\nzone: string,\n}) => any;\n\n'
        "} // namespace functions<|end|>"
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        # a call made before the final answer: its analysis is dropped (a later final answer exists)
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\\"temp\\": 20}"<|end|>'
        "<|start|>assistant<|channel|>final<|message|>Warm as a summer riddle.<|end|>"
        "<|start|>user<|message|>And now?<|end|><|start|>assistant"
    )
    assert render(template(SOURCE), messages, True, tools=TOOLS, reasoning_effort="high") == expected
    assert format_for_template(template(SOURCE)) == "harmony"


def test_past_turns_as_the_template_expects():
    """An OpenAI-style history (``reasoning_content``) renders as the template's ``thinking``:
    kept before a call that no final answer follows, dropped from a final answer."""
    from mlxformer.server.toolcalls.harmony import harmony_messages

    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "CET"}}}
    history = [{"role": "user", "content": "Time?"},
               {"role": "assistant", "content": "Let me look.", "reasoning_content": "Need the tool.", "tool_calls": [call]},
               {"role": "tool", "content": "12:00"}]
    text = render(template(SOURCE), harmony_messages(history), True, tools=TOOLS)
    assert ("<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
            '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "CET"}<|call|>') in text
    later = [*history, {"role": "assistant", "content": "Noon.", "reasoning_content": "Easy."}, {"role": "user", "content": "Thanks"}]
    text = render(template(SOURCE), harmony_messages(later), True, tools=TOOLS)
    assert "Need the tool." not in text and "Easy." not in text and "<|channel|>final<|message|>Noon.<|end|>" in text


def parse(text: str, pieces: list[str] | None = None):
    """(reasoning, content, calls as (name, arguments)) of a reply fed in ``pieces`` (default whole)."""
    stream = reply_stream(call_format("harmony"), SPEC)
    parts = [stream.feed(p) for p in (pieces if pieces is not None else [text])] + [stream.finish()]
    reasoning, content = "".join(p.reasoning for p in parts), "".join(p.content for p in parts)
    folded: dict[int, list[str]] = {}
    for delta in (d for p in parts for d in p.calls):
        folded.setdefault(delta.index, []).append(delta.arguments)
        if delta.name is not None:
            assert folded[delta.index] == [""] and delta.id
    calls = [(c.name, c.arguments) for c in stream.calls]
    assert ["".join(folded[i]) for i in range(len(calls))] == [a for _, a in calls]
    return reasoning, content, calls


THINK, ANSWER = "The user wants Paris; <b> and {braces} are fine.", "It is {\"sunny\"} < 30 degrees & dry."
REPLIES = {
    "reasoning then final": (
        f"<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>",
        (THINK, ANSWER, [])),
    "reasoning then a call": (
        f"<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
        '<|constrain|>json<|message|>{"city": "Paris"}<|call|>',
        (THINK, "", [("get_weather", '{"city": "Paris"}')])),
    "two calls": (
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
        '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "CET"}<|call|>',
        ("", "", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')])),
    "cut mid-call by max_tokens": (
        f"<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant<|channel|>commentary to=functions.get_time "
        '<|constrain|>json<|message|>{"zone": "CE',
        (THINK, "", [("get_time", '{"zone": "CE')])),
    "final only, no end token": (f"<|channel|>final<|message|>{ANSWER}", ("", ANSWER, [])),
}


@pytest.mark.parametrize("name", list(REPLIES))
def test_replies_split_at_every_point(name):
    text, expected = REPLIES[name]
    assert parse(text) == expected
    for at in range(1, len(text)):
        assert parse(text, [text[:at], text[at:]]) == expected, at
    assert parse(text, list(text)) == expected


def test_template_written_replies_parse_back():
    """What the template renders for an assistant turn with a call parses to that call."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "CET"}}}
    text = rendered_reply(template(SOURCE), [{"role": "user", "content": "Time?"}],
                          {"role": "assistant", "content": "", "thinking": THINK, "tool_calls": [call]}, tools=TOOLS)
    reasoning, content, calls = parse(text, list(text))
    assert (reasoning, content) == (THINK, "") and [(n, json.loads(a)) for n, a in calls] == [("get_time", {"zone": "CET"})]
    assert not any(t in reasoning + content for t in CONTROL)


# ---------------------------------------------------------------- the three APIs, official clients

SPECIALS = ["<|endoftext|>", "<|return|>", "<|call|>", *[t for t in CONTROL if t not in ("<|return|>", "<|call|>")]]
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}


def write_harmony_tokenizer(directory) -> int:
    """A byte-level tokenizer with Harmony's control tokens as special tokens, the gpt-oss
    template, and gpt-oss's end-of-sequence ids (``<|return|>``, ``<|call|>``, ``<|endoftext|>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256 + len(SPECIALS), special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["a"], trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>",
                                                                 "chat_template": template(SOURCE)}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2, 0]}))
    return tok.get_vocab_size()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import mlx.core as mx
    from server_support import running_engine, running_server

    from conftest import cpu_default_device, write_tiny_checkpoint
    from mlxformer import load
    from test_gpt_oss import GPT_OSS

    directory = tmp_path_factory.mktemp("harmony")
    vocab = write_harmony_tokenizer(directory)
    write_tiny_checkpoint(directory, "gpt_oss", **{**GPT_OSS, "vocab_size": vocab, "max_position_embeddings": 2048})
    write_harmony_tokenizer(directory)  # save_pretrained may have written its own config
    with cpu_default_device():
        model, tokenizer = load(directory, dtype=mx.float32, threads=1)
        with running_engine(model, tokenizer, max_batch=2) as engine:
            with running_server(engine, model, tokenizer) as url:
                yield url


def test_chat_completions_forced_call_and_effort(served):
    import openai

    client = openai.OpenAI(base_url=served + "/v1", api_key="unused", max_retries=0, timeout=300)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER_SCHEMA}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    kwargs: dict = dict(model=MODEL_NAME, messages=messages, tools=tools, tool_choice="required", max_tokens=200, temperature=0)
    reply = client.chat.completions.create(**kwargs)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and reply.choices[0].finish_reason == "tool_calls"
    import jsonschema

    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
    assert not any(t in (reply.choices[0].message.content or "") for t in CONTROL)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = "".join(tc.function.arguments or "" for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or [])
    assert streamed == call.function.arguments
    # reasoning_effort -> the template's "Reasoning: low|medium|high" (one byte a token here)
    sizes = {effort: client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1, reasoning_effort=effort
                                                    ).usage.prompt_tokens for effort in ("low", "high")}
    default = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1).usage.prompt_tokens
    assert (sizes["high"] - sizes["low"], default - sizes["low"]) == (1, 3)  # "high", "medium" vs "low"


def test_responses_forced_call_and_effort(served):
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=served + "/v1", api_key="unused", max_retries=0, timeout=300)
    tool = {"type": "function", "name": "get_weather", "description": "weather", "parameters": WEATHER_SCHEMA}
    reply = client.responses.create(model=MODEL_NAME, input="Weather in Paris?", tools=[tool], tool_choice="required",
                                    max_output_tokens=200, temperature=0)
    (call,) = [item for item in reply.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    low, high = (client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=1, reasoning={"effort": e}
                                         ).usage.input_tokens for e in ("low", "high"))
    assert high - low == 1


def test_anthropic_messages_forced_tool_use_and_thinking_budget(served):
    import anthropic
    import jsonschema

    client = anthropic.Anthropic(base_url=served, api_key="unused", max_retries=0, timeout=300)
    tool = {"name": "get_weather", "description": "weather", "input_schema": WEATHER_SCHEMA}
    user = [{"role": "user", "content": "Weather in Paris?"}]
    reply = client.messages.create(model=MODEL_NAME, max_tokens=200, messages=user, tools=[tool], tool_choice={"type": "any"})
    (use,) = [block for block in reply.content if block.type == "tool_use"]
    assert use.name == "get_weather" and reply.stop_reason == "tool_use"
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    usages = [client.messages.create(model=MODEL_NAME, max_tokens=1, messages=user,
                                     thinking={"type": "enabled", "budget_tokens": budget}).usage
              for budget in (1024, 20000)]
    # the prompt's tokens: those computed and those read from the prompt cache (the second
    # request reuses the first's prefix now that a sliding window serves a hit)
    low, high = (u.input_tokens + (u.cache_read_input_tokens or 0) for u in usages)
    assert high - low == 1  # budget 1024 -> "Reasoning: low", 20000 -> "high"


def test_a_tool_without_a_description_renders():
    """OpenAI's ``description`` is optional; the gpt-oss template reads it unconditionally, so the
    tools handed to templates carry an empty one (it failed with "no attribute 'description'")."""
    from mlxformer.constrained.tools import with_tools

    bare = [{"type": "function", "function": {"name": "get_time", "parameters": PARAMETERS["get_time"]}}]
    user = [{"role": "user", "content": "Time?"}]
    with pytest.raises(Exception, match="description"):
        render(template(SOURCE), user, True, tools=bare)
    messages, variables = with_tools(user, bare, template(SOURCE))
    assert "type get_time = (_: {" in render(template(SOURCE), messages, True, **variables)
