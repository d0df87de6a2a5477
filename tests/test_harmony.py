"""Harmony (gpt-oss): the chat template llama.cpp ships (``models/templates/openai-gpt-oss-120b.jinja``
of the llama-cpp-python sdist, read by ``agent_support.template``) rendered by our sandboxed
jinja against the format's known output (OpenAI's Harmony guide: system message with the
``Reasoning:`` level, developer message with the TypeScript-like ``functions`` namespace,
past calls with their analysis kept only before a call); the Harmony parser on hand-written
replies and the template's own, split at every point (streamed = whole, no control token in
content); and through the three APIs with the official ``openai`` and ``anthropic`` clients on
a tiny random gpt-oss with a Harmony tokenizer (the control tokens as special tokens), where
a forced call (the grammar) parses back to a valid call on each.

(``openai-harmony`` cannot run offline here: it downloads its o200k vocabulary at run time.)
"""

from __future__ import annotations

import datetime
import json

import pytest
from agent_support import render, rendered_reply, template

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
