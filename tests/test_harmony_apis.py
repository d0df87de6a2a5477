"""Hand-written Harmony completions (reasoning then final; reasoning then a call; two calls;
content with ``<`` and ``{``; a reply cut by ``max_tokens`` mid-call) as a model's output, through
the real server routes with the official ``openai`` and ``anthropic`` clients: Chat Completions,
Responses and Anthropic Messages, whole and streamed.

The model is the tiny random gpt-oss of tests/test_harmony.py with its Harmony tokenizer, and
its vocabulary projection is scripted (the stand-in sits at the model's logits, not at the
engine): at each sampling step the logits put the completion's next token above all others,
counted from the prompt's prefill (a multi-token ``hidden_states`` call). Everything after the
logits is the real path: the engine's sampling, stop ids (``<|return|>``, ``<|call|>``) and
``max_tokens``, the detokenizer, the Harmony parser and each API's translation. Each completion
runs twice: with the control tokens as the special ids a gpt-oss writes (each arrives whole),
and spelled out a character a token (the closing stop id excepted), so the routes get the reply
one character an event: split at every point, the parser's hold-back of a partial control
token checked through the APIs. (Weights that say a scripted text need a position signal from
the reply's start; a bigram table as tests/word_model.py writes cannot, as these completions
repeat ``<|message|>`` and letters. That was not built in the time this had.)

The expectations are the completions' own parts, written by hand below, never our output;
streamed replies are folded and compared with them and with the whole reply. Past turns: the
prompt the engine receives for a history with reasoning and a call (each API's way of sending
it) keeps the analysis before the call and drops it from a turn with a final answer, as the
gpt-oss template expects.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from server_support import MODEL_NAME
from test_harmony import CONTROL

THINK = "The user wants Paris; <b> and {braces} are fine."
ANSWER = 'It is {"sunny"} < 30 degrees & dry.'
WEATHER = ("get_weather", {"city": "Paris"})
TIME = ("get_time", {"zone": "CET"})
CALL_TEXT = '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone": "CET"}<|call|>'
# name: (completion, reasoning, content, calls as (name, arguments), cut after this prefix or None).
# A call cut by max_tokens is kept as written (as OpenAI's and Anthropic's APIs do), never as a
# valid call: Chat's finish_reason is "length" (not "tool_calls"), the Responses item is
# "incomplete", the Anthropic stop_reason "max_tokens" (not "tool_use") and its input is not
# made up (the partial JSON as written, streamed; {} whole, as it does not parse).
COMPLETIONS = {
    "reasoning then final": (
        f"<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>",
        THINK, ANSWER, [], None),
    "reasoning then a call": (
        f"<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
        '<|constrain|>json<|message|>{"city": "Paris"}<|call|>',
        THINK, "", [WEATHER], None),
    # <|call|> ends a reply (a stop id), so the first call ends with <|end|> here, as a model may write it
    "two calls": (
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|end|>'
        '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "CET"}<|call|>',
        "", "", [WEATHER, TIME], None),
    "content with < and {": (
        f"<|channel|>final<|message|>{ANSWER} <|x> {{\"a\": [1, 2]}} <|constrain <|return|>",
        "", f'{ANSWER} <|x> {{"a": [1, 2]}} <|constrain ', [], None),
    "cut mid-call by max_tokens": (
        f"<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant{CALL_TEXT}",
        THINK, "", [("get_time", '{"zone": "CE')], '{"zone": "CE'),
}
PARAMETERS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
              "get_time": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}


class Script:
    """The scripted vocabulary projection: ``tokens`` (None: the model's own logits) and the
    step within them, reset by every prefill."""

    def __init__(self) -> None:
        self.tokens: list[int] | None = None
        self.step = 0
        self.prompts: list[list[int]] = []


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import mlx.core as mx
    from server_support import running_engine, running_server

    from conftest import cpu_default_device, write_tiny_checkpoint
    from mlxformer import load
    from test_gpt_oss import GPT_OSS
    from test_harmony import write_harmony_tokenizer

    directory = tmp_path_factory.mktemp("harmony_apis")
    vocab = write_harmony_tokenizer(directory)
    write_tiny_checkpoint(directory, "gpt_oss", **{**GPT_OSS, "vocab_size": vocab, "num_hidden_layers": 1,
                                                    "max_position_embeddings": 2048})
    write_harmony_tokenizer(directory)
    script = Script()
    with cpu_default_device():
        model, tokenizer = load(directory, dtype=mx.float32, threads=1)
        base = type(model)

        class Scripted(base):  # type: ignore[misc, valid-type]
            def hidden_states(self, inputs, cache=None, rope_length=None, keep=None):
                if inputs.shape[1] > 1:  # a prompt (or a chunk of one): the reply starts again
                    script.step = 0
                return super().hidden_states(inputs, cache, rope_length, keep)

            def logits(self, hidden):
                out = super().logits(hidden)
                if script.tokens is None:
                    return out
                token = script.tokens[min(script.step, len(script.tokens) - 1)]
                script.step += 1
                return mx.where(mx.arange(out.shape[-1]) == token, 100.0, -100.0) + 0 * out

        model.__class__ = Scripted
        with running_engine(model, tokenizer, max_batch=1) as engine:
            submit = engine.submit

            def recording(request):
                script.prompts.append(list(request.prompt_ids))
                return submit(request)

            engine.submit = recording
            with running_server(engine, model, tokenizer) as url:
                yield SimpleNamespace(url=url, script=script, tokenizer=tokenizer)


def scripted(server, name: str, spelled: bool = False) -> tuple[str, int | None]:
    """Script the completion ``name``; its text and the max_tokens that cuts it (None: not cut).
    ``spelled``: every control token but the closing stop id written as its characters (a
    token each), so the routes receive the reply one character an event: split at every point."""
    text, *_, cut = COMPLETIONS[name]
    tokenizer = server.tokenizer
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text and [t in tokenizer.eos_token_ids for t in ids].index(True) == len(ids) - 1
    if spelled:
        ids = [t for ch in tokenizer.decode(ids[:-1]) for t in tokenizer.encode(ch, add_special_tokens=False)] + ids[-1:]
        assert tokenizer.decode(ids) == text and len(ids) == len(tokenizer.decode(ids[:-1])) + 1
    server.script.tokens = ids
    if cut is None:
        return text, None
    head = text[: text.index(cut) + len(cut)]
    return text, next(k for k in range(len(ids)) if tokenizer.decode(ids[:k]) == head)


def no_control(*texts: str | None) -> None:
    for text in texts:
        assert not any(t in (text or "") for t in CONTROL), text


def as_calls(pairs) -> list[tuple[str, dict | str]]:
    """(name, arguments parsed, or as written when they do not parse: a cut call)."""
    out = []
    for name, arguments in pairs:
        try:
            out.append((name, json.loads(arguments) if isinstance(arguments, str) else arguments))
        except json.JSONDecodeError:
            out.append((name, arguments))
    return out


# ---------------------------------------------------------------- Chat Completions


@pytest.mark.parametrize("spelled", [False, True], ids=["control-tokens", "spelled"])
def test_chat_completions(server, spelled):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    tools = [{"type": "function", "function": {"name": n, "description": n, "parameters": p}} for n, p in PARAMETERS.items()]
    for name, (_, reasoning, content, calls, cut) in COMPLETIONS.items():
        _, limit = scripted(server, name, spelled)
        kwargs: dict = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Weather?"}], tools=tools,
                            max_tokens=limit or 400, temperature=0)
        choice = client.chat.completions.create(**kwargs).choices[0]
        message = choice.message
        got = (message.reasoning_content or "", message.content or "",
               as_calls((c.function.name, c.function.arguments) for c in message.tool_calls or []))
        assert got == (reasoning, content, as_calls(calls)), name
        no_control(*got[:2], *(c.function.arguments for c in message.tool_calls or []))
        assert choice.finish_reason == ("length" if cut else "tool_calls" if calls else "stop"), name
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        folded: dict[int, list] = {}
        for tc in (tc for d in deltas for tc in d.tool_calls or []):
            entry = folded.setdefault(tc.index, [None, ""])
            entry[0] = entry[0] or tc.function.name
            entry[1] += tc.function.arguments or ""
        streamed = ("".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
                    "".join(d.content or "" for d in deltas), as_calls(folded[i] for i in sorted(folded)))
        assert streamed == got, name
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
            [choice.finish_reason], name


# ---------------------------------------------------------------- Responses


@pytest.mark.parametrize("spelled", [False, True], ids=["control-tokens", "spelled"])
def test_responses(server, spelled):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    tools = [{"type": "function", "name": n, "description": n, "parameters": p} for n, p in PARAMETERS.items()]
    for name, (_, reasoning, content, calls, cut) in COMPLETIONS.items():
        _, limit = scripted(server, name, spelled)
        kwargs: dict = dict(model=MODEL_NAME, input="Weather?", tools=tools, max_output_tokens=limit or 400, temperature=0)
        reply = client.responses.create(**kwargs)

        def parts(output) -> tuple[str, str, list]:
            thought = "".join(c.text for item in output if item.type == "reasoning" for c in item.content or [])
            text = "".join(c.text for item in output if item.type == "message" for c in item.content)
            return thought, text, as_calls((i.name, i.arguments) for i in output if i.type == "function_call")

        got = parts(reply.output)
        assert got == (reasoning, content, as_calls(calls)), name
        no_control(*got[:2])
        assert reply.status == ("incomplete" if cut else "completed"), name
        if cut:
            assert reply.incomplete_details.reason == "max_output_tokens"
            assert [i.status for i in reply.output if i.type == "function_call"] == ["incomplete"]
        events = list(client.responses.create(**kwargs, stream=True))
        final = events[-1].response
        assert events[-1].type == ("response.incomplete" if cut else "response.completed"), name
        assert parts(final.output) == got, name
        done = [e.item for e in events if e.type == "response.output_item.done"]
        assert parts(done) == got, name
        deltas = {kind: "".join(e.delta for e in events if e.type == kind) for kind in (
            "response.reasoning_text.delta", "response.output_text.delta")}
        assert (deltas["response.reasoning_text.delta"], deltas["response.output_text.delta"]) == got[:2], name
        arguments: dict[int, str] = {}
        for e in events:
            if e.type == "response.function_call_arguments.delta":
                arguments[e.output_index] = arguments.get(e.output_index, "") + e.delta
        assert [arguments.get(i, "") for i, item in enumerate(final.output) if item.type == "function_call"] == \
            [item.arguments for item in final.output if item.type == "function_call"], name


# ---------------------------------------------------------------- Anthropic Messages


@pytest.mark.parametrize("spelled", [False, True], ids=["control-tokens", "spelled"])
def test_anthropic_messages(server, spelled):
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    tools = [{"name": n, "description": n, "input_schema": p} for n, p in PARAMETERS.items()]
    for name, (_, reasoning, content, calls, cut) in COMPLETIONS.items():
        _, limit = scripted(server, name, spelled)
        kwargs: dict = dict(model=MODEL_NAME, max_tokens=limit or 400, tools=tools,
                            messages=[{"role": "user", "content": "Weather?"}])
        reply = client.messages.create(**kwargs)

        def parts(blocks) -> tuple[str, str, list]:
            return ("".join(b.thinking for b in blocks if b.type == "thinking"),
                    "".join(b.text for b in blocks if b.type == "text"),
                    [(b.name, b.input) for b in blocks if b.type == "tool_use"])

        got = parts(reply.content)
        assert got == (reasoning, content, [(n, {} if cut else a) for n, a in as_calls(calls)]), name
        no_control(*got[:2])
        assert reply.stop_reason == ("max_tokens" if cut else "tool_use" if calls else "end_turn"), name
        with client.messages.stream(**kwargs) as stream:
            events = list(stream)
            final = stream.get_final_message()
        assert parts(final.content)[:2] == got[:2] and final.stop_reason == reply.stop_reason, name
        deltas = [e.delta for e in events if e.type == "content_block_delta"]
        assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == reasoning, name
        assert "".join(d.text for d in deltas if d.type == "text_delta") == content, name
        starts = [(e.index, e.content_block.name) for e in events
                  if e.type == "content_block_start" and e.content_block.type == "tool_use"]
        written = [(n, "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                               and e.index == i and e.delta.type == "input_json_delta")) for i, n in starts]
        assert as_calls(written) == as_calls(calls), name  # the JSON as the model wrote it, cut or not


# ---------------------------------------------------------------- past turns


def prompt_of(server) -> str:
    return server.tokenizer.decode(server.script.prompts[-1])


ANALYSIS_BEFORE_CALL = (f"<|start|>assistant<|channel|>analysis<|message|>{THINK}<|end|>"
                        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>')


def test_past_turns_through_the_apis(server):
    """A history: user, assistant (reasoning + a call), the call's result. Its analysis is sent
    back before the call; once a later turn answers (with its own reasoning), both are dropped."""
    import anthropic
    import openai

    scripted(server, "reasoning then final")
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    tools = [{"type": "function", "function": {"name": n, "description": n, "parameters": p}} for n, p in PARAMETERS.items()]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "reasoning_content": THINK, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    oai.chat.completions.create(model=MODEL_NAME, messages=history, tools=tools, max_tokens=400)
    assert ANALYSIS_BEFORE_CALL in prompt_of(server)
    later = [*history, {"role": "assistant", "content": ANSWER, "reasoning_content": "Answer now."},
             {"role": "user", "content": "Thanks"}]
    oai.chat.completions.create(model=MODEL_NAME, messages=later, tools=tools, max_tokens=400)
    text = prompt_of(server)
    assert THINK not in text and "Answer now." not in text and f"<|channel|>final<|message|>{ANSWER}<|end|>" in text
    no_leak = text.split("<|start|>user<|message|>Thanks")[0]
    assert '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>' \
        in no_leak

    # Responses: reasoning item, function_call item, its output
    oai.responses.create(model=MODEL_NAME, max_output_tokens=400, tools=[
        {"type": "function", "name": n, "description": n, "parameters": p} for n, p in PARAMETERS.items()], input=[
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": THINK}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    assert ANALYSIS_BEFORE_CALL in prompt_of(server)

    # Anthropic: a thinking block before the tool_use block
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    claude.messages.create(model=MODEL_NAME, max_tokens=400, tools=[
        {"name": n, "description": n, "input_schema": p} for n, p in PARAMETERS.items()], messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": THINK, "signature": "x"},
                                          {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sunny"}]}])
    assert ANALYSIS_BEFORE_CALL in prompt_of(server)
