"""Tool-call parsing per format, on replies written by each family's published chat template
(llama.cpp's copies in ``models/templates/``): an assistant turn with text and calls is rendered
by the template, and its text is parsed whole and fed one character at a time (every split a
tokenizer could make). Streamed = whole, the text before a call is kept and is out before the
call is, no marker reaches the content, arguments match the calls the template was given."""

from __future__ import annotations

import json
import random

import pytest
from agent_support import rendered_reply, template, write_chat_tokenizer

from mlxformer.server.toolcalls import FORMATS, ToolSpec, call_format, format_for_template, reply_stream

PARAMETERS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                     "metric": {"type": "boolean"}}, "required": ["city"]},
    "get_time": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
}
TOOLS = [{"type": "function", "function": {"name": n, "description": n, "parameters": p}} for n, p in PARAMETERS.items()]
SPEC = ToolSpec(PARAMETERS)
CALLS = [("get_weather", {"city": "Paris, \"FR\"", "days": 3, "metric": True}), ("get_time", {"zone": "CET"})]
TEXT = "Let me check that for you."
USER = [{"role": "user", "content": "Weather in Paris, and the time?"}]
MARKERS = ("<tool_call>", "</tool_call>", "<function=", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", '"name"')

# (llama.cpp template, expected format, calls it can render, whether it renders text next to calls)
FAMILIES = [
    ("Qwen-Qwen2.5-7B-Instruct", "hermes", 2, True),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "hermes", 2, False),
    ("Qwen-Qwen3-0.6B", "hermes", 2, True),
    ("Qwen3-Coder", "qwen3_coder", 2, True),
    ("Qwen3.5-4B", "qwen3_coder", 2, True),  # Qwen3.5/3.6 (hybrid Gated DeltaNet models)
    ("meta-llama-Llama-3.1-8B-Instruct", "llama3_json", 1, False),
    ("meta-llama-Llama-3.2-3B-Instruct", "llama3_json", 1, False),
    ("mistralai-Mistral-Nemo-Instruct-2407", "mistral", 2, False),
    ("Mistral-Small-3.2-24B-Instruct-2506", "mistral_v11", 2, False),
    ("unsloth-mistral-Devstral-Small-2507", "mistral_v11", 2, False),
    ("mistralai-Ministral-3-14B-Reasoning-2512", "mistral_v11", 2, True),
]


def parse_whole(fmt, text):
    stream = reply_stream(fmt, SPEC)
    content = stream.feed(text).content + stream.finish().content
    return content, stream.calls


def parse_pieces(fmt, pieces):
    """Feed ``pieces`` one by one: the content handed out after each, and all call deltas."""
    stream = reply_stream(fmt, SPEC)
    contents, deltas = [], []
    for piece in pieces:
        parsed = stream.feed(piece)
        contents.append(parsed.content)
        deltas += parsed.calls
    tail = stream.finish()
    contents.append(tail.content)
    return contents, deltas + tail.calls, stream.calls


def family_reply(name: str, n_calls: int, with_text: bool) -> str:
    calls = [{"id": f"abcdefgh{i}", "type": "function", "function": {"name": c, "arguments": a}}
             for i, (c, a) in enumerate(CALLS[:n_calls])]
    reply = {"role": "assistant", "content": TEXT if with_text else "", "tool_calls": calls}
    return rendered_reply(template(name), USER, reply, tools=TOOLS)


@pytest.mark.parametrize("name,expected,n_calls,with_text", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_family_template_replies(name, expected, n_calls, with_text):
    source = template(name)
    assert format_for_template(source) == expected
    fmt = call_format(expected)
    text = family_reply(name, n_calls, with_text).split("</think>")[-1]  # Qwen3's (empty) reasoning goes first
    content, calls = parse_whole(fmt, text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS[:n_calls], text
    assert len({c.id for c in calls}) == n_calls
    if expected.startswith("mistral"):
        assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)  # what Mistral's templates accept
    assert content.strip() == (TEXT if with_text else "")
    assert not any(m in content for m in MARKERS)

    contents, deltas, streamed = parse_pieces(fmt, list(text))
    assert "".join(contents) == content
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    for index, call in enumerate(streamed):
        mine = [d for d in deltas if d.index == index]
        assert mine[0].id == call.id and mine[0].name == call.name and mine[0].arguments == ""
        assert all(d.id is None and d.name is None for d in mine[1:])
        assert "".join(d.arguments for d in mine) == call.arguments
    if with_text:  # the text was out before the call was complete
        first_call_done = next(i for i in range(len(text)) if parse_whole_prefix_has_call(fmt, text[: i + 1]))
        assert "".join(contents[:first_call_done]).strip().startswith(TEXT)


def parse_whole_prefix_has_call(fmt, prefix: str) -> bool:
    stream = reply_stream(fmt, SPEC)
    stream.feed(prefix)
    return bool(stream.calls)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_random_splits_agree(name):
    """Every format, fed its own forced-call form and random chunks, agrees with the whole parse."""
    fmt = call_format(name)
    texts = {
        "hermes": '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
        "json": '```json\n[{"name": "get_time", "arguments": {"zone": "CET"}}]\n```',
        "llama3_json": '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}',
        "mistral": '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]',
        "mistral_v11": '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
        "qwen3_coder": "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>",
        "glm": "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>CET</arg_value>\n</tool_call>",
        "glm47": "<tool_call>get_time<arg_key>zone</arg_key><arg_value>CET</arg_value></tool_call>",
        "deepseek_v3_1": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"zone\": \"CET\"}"
                         "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "gemma4": '<|tool_call>call:get_time{zone:<|"|>CET<|"|>}<tool_call|>',
        "harmony": '<|channel|>final<|message|>Sure. <|end|><|start|>assistant<|channel|>commentary to=functions.get_time '
                   '<|constrain|>json<|message|>{"zone": "CET"}<|call|>',
    }
    text = "Sure. " + texts[name] if name not in ("json", "llama3_json", "harmony") else texts[name]
    whole_content, whole_calls = parse_whole(fmt, text)
    assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == [("get_time", {"zone": "CET"})]
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), 5))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        contents, _, calls = parse_pieces(fmt, pieces)
        assert "".join(contents) == whole_content
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]


@pytest.mark.parametrize("reply", [
    '{"answer": 42, "name": "x"}', "```python\nprint('hi')\n```", "[1, 2, 3]", '{"name": "Alice", "age": 3}',
])
def test_json_that_is_no_call_streams_at_once(reply):
    """A reply that merely begins like JSON is content, and is let out as soon as it cannot be a call
    (not held to the end: a code answer used to arrive as one chunk)."""
    for name in ("json", "llama3_json"):
        contents, deltas, calls = parse_pieces(call_format(name), list(reply))
        assert "".join(contents) == reply and not calls and not deltas
        held = len(reply) - len("".join(contents[:-1]))
        assert held <= len('{"name": "Alice"'), (name, contents)


def test_marker_prefix_is_held_only_while_it_may_be_one():
    fmt = call_format("hermes")
    contents, _, calls = parse_pieces(fmt, ["Use <tool", "s> wisely, <tool_c", "all> is a tag"])
    assert contents[0] == "Use " and contents[1] == "<tools> wisely, " and not calls
    assert "".join(contents) == "Use <tools> wisely, <tool_call> is a tag"


def test_cut_off_call_and_unknown_function():
    fmt = call_format("hermes")
    _, calls = parse_whole(fmt, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Pa')]  # as written, max_tokens hit
    content, calls = parse_whole(call_format("json"), '{"name": "delete_everything", "arguments": {}}')
    assert not calls and content.startswith("{")  # a bare JSON call must name an offered function


@pytest.mark.parametrize("name,family", [
    ("hermes", "Qwen-Qwen2.5-7B-Instruct"), ("qwen3_coder", "Qwen3-Coder"), ("llama3_json", "meta-llama-Llama-3.1-8B-Instruct"),
    ("mistral", "mistralai-Mistral-Nemo-Instruct-2407"), ("mistral_v11", "unsloth-mistral-Devstral-Small-2507"),
    ("gemma4", "google-gemma-4-31B-it"), ("json", None),
])
def test_forced_grammar_is_the_family_format(name, family, byte_tokenizer):
    """A forced call is constrained to the family's own form: the call its template renders
    (llguidance matcher over a byte-level vocabulary) is accepted whole, and a call in another
    format is not."""
    import llguidance

    from mlxformer.constrained.vocab import grammar_tokenizer

    fmt = call_format(name)
    grammar = fmt.forced_grammar(["get_weather", "get_time"], SPEC)
    call = [{"id": "abcdefgh0", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "CET"}}}]
    if family is None:
        text = '{"name": "get_time", "arguments": {"zone": "CET"}}'
    else:
        thinking = {"enable_thinking": True} if name == "gemma4" else {}  # Gemma 4's prompt otherwise closes a thought
        text = rendered_reply(template(family), USER, {"role": "assistant", "content": "", "tool_calls": call}, tools=TOOLS,
                              **thinking)
        text = text.split('[CALL_ID]')[0] + text[text.index("[ARGS]"):] if "[CALL_ID]" in text else text
        text = text.split("<|tool_response>")[0]  # Gemma 4 opens the tool's turn right after the call
    lltok = grammar_tokenizer(byte_tokenizer, byte_tokenizer.vocab_size)

    def accepts(candidate: str) -> bool:
        matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        ok = all(matcher.consume_token(t) for t in byte_tokenizer.encode(candidate, add_special_tokens=False))
        return ok and matcher.is_accepting()

    assert accepts(text), text
    assert parse_whole(fmt, text)[1][0].name == "get_time"
    other = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>' if name != "hermes" \
        else '{"name": "get_time", "arguments": {"zone": "CET"}}'
    assert not accepts(other)
    assert not accepts(text.replace("get_time", "get_date"))


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    from mlxformer.text.tokenizer import load_tokenizer_from_dir

    directory = tmp_path_factory.mktemp("bytes")
    write_chat_tokenizer(directory)
    return load_tokenizer_from_dir(directory)


LONG_REPLIES = {  # a 100k-character argument (a file's text, say), in each family's form
    "hermes": lambda v: '<tool_call>\n{"name": "get_time", "arguments": ' + json.dumps({"zone": v}) + "}\n</tool_call>",
    "qwen3_coder": lambda v: f"<tool_call>\n<function=get_time>\n<parameter=zone>\n{v}\n</parameter>\n</function>\n</tool_call>",
    "llama3_json": lambda v: '{"name": "get_time", "parameters": ' + json.dumps({"zone": v}) + "}",
    "mistral": lambda v: '[TOOL_CALLS][{"name": "get_time", "arguments": ' + json.dumps({"zone": v}) + "}]",
    "mistral_v11": lambda v: "[TOOL_CALLS]get_time[ARGS]" + json.dumps({"zone": v}),
}


@pytest.mark.parametrize("name", sorted(LONG_REPLIES))
def test_streamed_parsing_is_linear_in_the_reply(name):
    """Fed 4 characters at a time, a 100k-character call is read over at most a few times its
    length in all (the open call is not re-read on every piece), and its streamed deltas equal
    the whole parse: the argument as given."""
    value = 'line "one" {x: [1, 2]} <tag> \\ ' * 3200
    reply = LONG_REPLIES[name](value)
    fmt = call_format(name)
    read_chars = []
    original = fmt.read

    def counting(marker, body, final, tools):
        read_chars.append(len(body))
        return original(marker, body, final, tools)

    fmt.read = counting
    contents, deltas, calls = parse_pieces(fmt, [reply[i:i + 4] for i in range(0, len(reply), 4)])
    assert sum(read_chars) < 40 * len(reply), (sum(read_chars), len(reply))
    streamed = "".join(d.arguments for d in deltas)
    assert "".join(contents).strip() == "" and [(c.name, c.arguments) for c in calls] == [("get_time", streamed)]
    assert json.loads(streamed) == {"zone": value}
