"""A request without max_tokens under a KV budget smaller than one full context (issue 43): its
default (the rest of the context) is cut to what the budget holds for its prompt, and every API
says so before the first byte, in the ``x-mlxformer-max-tokens`` header, and in the usage
object (``usage.max_tokens``) of whole replies and of the final streamed usage. The reply ends
with a length cut after exactly that many tokens; a request with its own max_tokens gets
neither. Driven by the official ``openai``, ``anthropic`` and ``ollama`` clients (raw HTTP
where a client hides the headers) over a tiny random llama with SmolLM2's chat template and no
end-of-sequence token, so only the length limit ends a reply."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from server_support import MODEL_NAME, http, running_engine, running_server

HEADER = "x-mlxformer-max-tokens"
BUDGET_TOKENS = 256  # the KV budget holds one sequence of this many tokens (one cache block), alone
# prompts of most of the block: the cut leaves a few dozen tokens to generate (each test ~1 s)
TEXT = "Once upon a time there was a long story. " * 18
MESSAGES = [{"role": "user", "content": TEXT}]


@pytest.fixture(scope="module")
def server(tiny_smol):
    from types import SimpleNamespace

    from mlxformer import load
    from mlxformer.cache import CacheSettings
    from mlxformer.engine.memory import KVSizer

    model, tokenizer = load(tiny_smol[0], threads=1)
    tokenizer.eos_token_ids = []  # a random model's replies end at their length limit only
    sizer = KVSizer(model, CacheSettings())
    budget = sizer.peak(BUDGET_TOKENS)
    assert budget < sizer.peak(model.args.max_position_embeddings)  # smaller than one full context
    with running_engine(model, tokenizer, max_batch=2, max_kv_memory=budget) as engine:
        with running_server(engine, model, tokenizer) as url:
            yield SimpleNamespace(url=url, engine=engine, model=model, tokenizer=tokenizer, sizer=sizer, budget=budget,
                                  context=model.args.max_position_embeddings,
                                  openai=openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120),
                                  anthropic=anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120))


def check_cut(server, headers, prompt_tokens: int, completion_tokens: int, usage_max_tokens) -> None:
    """The header and the usage name the same cut: the most tokens the budget holds after this
    prompt, fewer than the context's rest, and the reply generated exactly that many."""
    cut = int(headers[HEADER])
    assert usage_max_tokens == cut == completion_tokens
    assert cut < server.context - prompt_tokens
    assert server.sizer.peak(prompt_tokens + cut) <= server.budget < server.sizer.peak(prompt_tokens + cut + 1)


def extra(usage, name: str):
    """A field the client's usage model does not declare (the clients keep extra fields)."""
    return (usage.model_extra or {}).get(name)


def test_chat_completions_whole_and_streamed(server):
    raw = server.openai.chat.completions.with_raw_response.create(model=MODEL_NAME, messages=MESSAGES, temperature=0)
    reply = raw.parse()
    assert reply.choices[0].finish_reason == "length"
    check_cut(server, raw.headers, reply.usage.prompt_tokens, reply.usage.completion_tokens,
              extra(reply.usage, "max_tokens"))

    with server.openai.chat.completions.with_streaming_response.create(
            model=MODEL_NAME, messages=MESSAGES, temperature=0, stream=True,
            stream_options={"include_usage": True}) as response:
        assert HEADER in response.headers  # before the first chunk is read
        chunks = list(response.parse())
    usage = chunks[-1].usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    check_cut(server, response.headers, usage.prompt_tokens, usage.completion_tokens, extra(usage, "max_tokens"))


def test_a_request_with_its_own_max_tokens_reports_no_cut(server):
    raw = server.openai.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=5)
    reply = raw.parse()
    assert HEADER not in raw.headers and "max_tokens" not in reply.usage.model_dump()
    assert (reply.choices[0].finish_reason, reply.usage.completion_tokens) == ("length", 5)
    status, headers, body = http(server.url, "POST", "/v1/messages", {
        "model": MODEL_NAME, "max_tokens": 5, "messages": MESSAGES})
    assert status == 200 and HEADER not in headers
    assert "max_tokens" not in json.loads(body)["usage"]


def test_completions_whole_and_streamed(server):
    raw = server.openai.completions.with_raw_response.create(model=MODEL_NAME, prompt=TEXT)
    reply = raw.parse()
    assert reply.choices[0].finish_reason == "length"
    check_cut(server, raw.headers, reply.usage.prompt_tokens, reply.usage.completion_tokens,
              extra(reply.usage, "max_tokens"))
    with server.openai.completions.with_streaming_response.create(
            model=MODEL_NAME, prompt=TEXT, stream=True, stream_options={"include_usage": True}) as response:
        chunks = list(response.parse())
    usage = chunks[-1].usage
    check_cut(server, response.headers, usage.prompt_tokens, usage.completion_tokens, extra(usage, "max_tokens"))


def test_responses_whole_and_streamed(server):
    raw = server.openai.responses.with_raw_response.create(model=MODEL_NAME, input=TEXT)
    reply = raw.parse()
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    check_cut(server, raw.headers, reply.usage.input_tokens, reply.usage.output_tokens,
              extra(reply.usage, "max_tokens"))
    with server.openai.responses.with_streaming_response.create(
            model=MODEL_NAME, input=TEXT, stream=True) as response:
        events = list(response.parse())
    final = events[-1].response
    assert events[-1].type == "response.incomplete"
    check_cut(server, response.headers, final.usage.input_tokens, final.usage.output_tokens,
              extra(final.usage, "max_tokens"))


def test_anthropic_messages_whole_and_streamed(server):
    """Anthropic's max_tokens is required: asked beyond the budget, it is cut the same way."""
    ask = {"model": MODEL_NAME, "max_tokens": 4096, "messages": MESSAGES}
    raw = server.anthropic.messages.with_raw_response.create(**ask)
    reply = raw.parse()
    assert reply.stop_reason == "max_tokens"
    usage = reply.usage
    check_cut(server, raw.headers, usage.input_tokens + usage.cache_read_input_tokens, usage.output_tokens,
              extra(usage, "max_tokens"))
    with server.anthropic.messages.with_streaming_response.create(**ask, stream=True) as response:
        events = list(response.parse())
    delta = next(e for e in events if e.type == "message_delta")
    prompt = next(e for e in events if e.type == "message_start").message.usage.input_tokens
    assert delta.delta.stop_reason == "max_tokens"
    check_cut(server, response.headers, prompt, delta.usage.output_tokens, extra(delta.usage, "max_tokens"))


@pytest.mark.parametrize("path, body", [
    ("/api/chat", {"messages": MESSAGES}),
    ("/api/generate", {"prompt": TEXT, "raw": True}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_ollama_chat_and_generate(server, path, body, stream):
    """Ollama's replies have no usage object: the header says it, ``eval_count`` is the cut."""
    status, headers, raw = http(server.url, "POST", path, {"model": MODEL_NAME, **body, "stream": stream})
    assert status == 200, raw[:300]
    final = json.loads(raw.decode().strip().splitlines()[-1])
    assert final["done_reason"] == "length"
    check_cut(server, headers, final["prompt_eval_count"], final["eval_count"], int(headers[HEADER]))


def test_a_page_on_an_allowed_origin_may_read_the_header(server):
    """A browser hides response headers from a cross-origin page unless they are exposed."""
    origin = "http://app.example"
    with running_server(server.engine, server.model, server.tokenizer, cors_origins=[origin]) as url:
        status, headers, raw = http(url, "POST", "/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES},
                                    headers={"Origin": origin})
    assert status == 200, raw[:300]
    assert headers["access-control-allow-origin"] == origin
    assert HEADER in headers["access-control-expose-headers"].lower().split(", ")
    assert int(headers[HEADER]) == json.loads(raw)["usage"]["max_tokens"]
