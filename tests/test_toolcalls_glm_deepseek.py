"""GLM's XML tool calls (GLM-4.5/4.6 and GLM-4.7's templates) and DeepSeek-V3.1's, on replies
written by llama.cpp's copies of the published templates (``GLM-4.6.jinja``,
``GLM-4.7-Flash.jinja``, ``deepseek-ai-DeepSeek-V3.1.jinja`` in ``models/templates/``): each
template selects its format, a reply with text and two calls parses back whole and streamed
one character at a time (streamed = whole), and a forced call (``tool_choice`` required) through
Chat Completions, Responses and Messages on a tiny model with the template parses back to a
valid call. Helpers are ``test_toolcall_formats.py``'s."""

from __future__ import annotations

import json

import jsonschema
import pytest
from agent_support import rendered_reply, template, tiny_chat_model
from server_support import MODEL_NAME, served
from test_toolcall_formats import CALLS, SPEC, TEXT, TOOLS, USER, parse_pieces, parse_whole

from mlxformer.server.toolcalls import call_format, format_for_template

# (llama.cpp template, its format, the end-of-turn text the template writes after the calls)
FAMILIES = [
    ("GLM-4.6", "glm", ""),
    ("GLM-4.7-Flash", "glm47", ""),
    ("deepseek-ai-DeepSeek-V3.1", "deepseek_v3_1", "<｜end▁of▁sentence｜>"),
]
MARKERS = ("<tool_call>", "</tool_call>", "<arg_key>", "<arg_value>", "｜tool▁")


def reply_text(name: str, calls: list[tuple[str, dict]], text: str) -> str:
    rendered = [{"id": f"abcdefgh{i}", "type": "function", "function": {"name": c, "arguments": a}}
                for i, (c, a) in enumerate(calls)]
    reply = {"role": "assistant", "content": text, "tool_calls": rendered}
    return rendered_reply(template(name), USER, reply, tools=TOOLS, enable_thinking=False)


@pytest.mark.parametrize("name,expected,end", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_template_replies_parse_whole_and_streamed(name, expected, end):
    assert format_for_template(template(name)) == expected
    fmt = call_format(expected)
    text = reply_text(name, CALLS, TEXT)
    assert text.endswith(end)
    text = text[: len(text) - len(end)]
    content, calls = parse_whole(fmt, text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS, text
    assert content.strip() == TEXT and not any(m in content for m in MARKERS)
    contents, deltas, streamed = parse_pieces(fmt, list(text))
    assert "".join(contents) == content
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    for index, call in enumerate(streamed):
        mine = [d for d in deltas if d.index == index]
        assert mine[0].name == call.name and "".join(d.arguments for d in mine) == call.arguments


def test_prose_mentioning_the_tag_is_content():
    for name in ("glm", "glm47"):
        contents, deltas, calls = parse_pieces(call_format(name), list("Use <tool_call> is a tag, ok"))
        assert "".join(contents) == "Use <tool_call> is a tag, ok" and not calls and not deltas


@pytest.mark.parametrize("name,expected,end", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_forced_grammar_accepts_the_template_call(name, expected, end, byte_tokenizer):
    import llguidance

    from mlxformer.constrained.vocab import grammar_tokenizer

    fmt = call_format(expected)
    grammar = fmt.forced_grammar(["get_weather", "get_time"], SPEC)
    text = reply_text(name, [("get_time", {"zone": "CET"})], "")
    text = text[: len(text) - len(end)].strip()
    lltok = grammar_tokenizer(byte_tokenizer, byte_tokenizer.vocab_size)

    def accepts(candidate: str) -> bool:
        matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        ok = all(matcher.consume_token(t) for t in byte_tokenizer.encode(candidate, add_special_tokens=False))
        return ok and matcher.is_accepting()

    assert accepts(text), text
    assert not accepts('<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    assert not accepts(text.replace("get_time", "get_date"))


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    from agent_support import write_chat_tokenizer

    from mlxformer.text.tokenizer import load_tokenizer_from_dir

    directory = tmp_path_factory.mktemp("bytes")
    write_chat_tokenizer(directory)
    return load_tokenizer_from_dir(directory)


ZONE = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["CET", "UTC"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["zone", "days"], "additionalProperties": False}
QUESTION = "What time is it in Paris?"


@pytest.mark.parametrize("name,expected,end", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_forced_call_through_the_three_apis(name, expected, end, tmp_path):
    """``tool_choice`` required on a tiny random model with the family's template (reasoning off:
    the GLM templates open ``<think>``, which a random model never closes): each API returns one
    call of the offered function whose arguments satisfy its schema."""
    import anthropic
    import openai

    model, tokenizer = tiny_chat_model(tmp_path, template(name))
    with served(model, tokenizer, max_batch=2) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
        chat = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": QUESTION}], max_tokens=400, temperature=0,
            tools=[{"type": "function", "function": {"name": "get_time", "parameters": ZONE}}], tool_choice="required",
            reasoning_effort="none")
        (call,) = chat.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), ZONE)
        assert call.function.name == "get_time" and chat.choices[0].finish_reason == "tool_calls"
        response = client.responses.create(
            model=MODEL_NAME, input=QUESTION, max_output_tokens=400, temperature=0,
            tools=[{"type": "function", "name": "get_time", "parameters": ZONE}], tool_choice="required",
            reasoning={"effort": "none"})
        (item,) = [o for o in response.output if o.type == "function_call"]
        assert item.name == "get_time"
        jsonschema.validate(json.loads(item.arguments), ZONE)
        messages = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=300).messages.create(
            model=MODEL_NAME, max_tokens=400, messages=[{"role": "user", "content": QUESTION}],
            tools=[{"name": "get_time", "input_schema": ZONE}], tool_choice={"type": "any"}, thinking={"type": "disabled"})
        (block,) = [b for b in messages.content if b.type == "tool_use"]
        assert block.name == "get_time" and messages.stop_reason == "tool_use"
        jsonschema.validate(block.input, ZONE)
