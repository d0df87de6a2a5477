"""What the agent CLIs send, accepted: the request bodies captured from Claude Code, Codex and
opencode (tests/data/agents/) replayed against ``serve`` on a tiny model that always answers
"banana" (``word_model``); the Messages API's system messages mid-conversation (prompt counted by
transformers' rendering of the template, without Claude Code's billing-header block), assistant
prefill (continued: the prompt is the template's generation prompt plus the prefill), a
``max_tokens`` beyond the context clamped (or refused, strict, in the wording Claude Code's retry
parses), ``message_start`` then ``ping`` events while no token comes, the Anthropic SDK's
``models.list()`` and ``HEAD /``."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import anthropic
import httpx
import pytest
from server_support import MODEL_NAME, http, running_engine, running_server
from word_model import WORD, write_word_model

DATA = Path(__file__).parent / "data" / "agents"
CONTEXT = 65536


@pytest.fixture(scope="module")
def server(hf_smollm_tokenizer, tmp_path_factory):
    from mlxformer import load

    directory = tmp_path_factory.mktemp("word_model")
    write_word_model(directory, hf_smollm_tokenizer, context=CONTEXT)
    model, tokenizer = load(directory, threads=1)
    with running_engine(model, tokenizer, max_batch=1) as engine:
        with running_server(engine, model, tokenizer, sse_ping_seconds=0.2) as url:
            with running_server(engine, model, tokenizer, strict_max_tokens=True) as strict:
                with running_server(engine, model, tokenizer, force_tools=["Bash"]) as forcing:
                    yield SimpleNamespace(url=url, strict=strict, forcing=forcing, model=model, tokenizer=tokenizer,
                                          hf=hf_smollm_tokenizer)


def sse_events(raw: str) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]


def replay(url: str, name: str) -> tuple[int, dict[str, str], str]:
    captured = json.loads((DATA / name).read_text())
    if captured["path"].startswith("/v1/chat/"):  # opencode names the model its config names: the served one
        captured["body"]["model"] = MODEL_NAME
    status, headers, body = http(url, "POST", captured["path"], captured["body"], captured["headers"], timeout=300)
    return status, headers, body.decode()


def test_claude_code_request_is_served(server):
    status, headers, raw = replay(server.url, "claude_code.json")
    assert status == 200, raw[:500]
    events = sse_events(raw)
    assert [e["type"] for e in events[:2]] == ["message_start", "ping"]
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert text == WORD and events[-1]["type"] == "message_stop"
    delta = next(e for e in events if e["type"] == "message_delta")
    prompt = events[0]["message"]["usage"]["input_tokens"]
    # 128000 asked: clamped to what the context has left, in the header and the usage
    assert int(headers["x-mlxformer-max-tokens"]) == delta["usage"]["max_tokens"] == CONTEXT - prompt
    assert delta["delta"]["stop_reason"] == "end_turn"


def expected_messages(body: dict) -> list[dict]:
    """Claude Code's request as chat messages, by hand: system blocks joined without the billing
    header, each message's text blocks joined, the system message kept where it stands."""
    system = "".join(b["text"] for b in body["system"] if not b["text"].startswith("x-anthropic-billing-header"))
    out = [{"role": "system", "content": system}]
    for m in body["messages"]:
        content = m["content"] if isinstance(m["content"], str) else "".join(b["text"] for b in m["content"])
        out.append({"role": m["role"], "content": content})
    return out


def test_system_messages_and_billing_header(server):
    body = json.loads((DATA / "claude_code.json").read_text())["body"]
    assert [m["role"] for m in body["messages"]] == ["user", "system"]
    assert body["system"][0]["text"].startswith("x-anthropic-billing-header:")
    count = {k: body[k] for k in ("model", "messages", "system")}  # tools are rendered by the server's own rule
    status, _, reply = http(server.url, "POST", "/v1/messages/count_tokens", count)
    assert status == 200, reply
    text = server.hf.apply_chat_template(expected_messages(body), add_generation_prompt=True, tokenize=False)
    assert json.loads(reply)["input_tokens"] == len(server.hf(text, add_special_tokens=False)["input_ids"])
    # the billing header (with a per-request hash) changes nothing in the prompt
    body["system"][0]["text"] += " cch=1234;"
    assert json.loads(http(server.url, "POST", "/v1/messages/count_tokens", {
        k: body[k] for k in ("model", "messages", "system")})[2])["input_tokens"] == json.loads(reply)["input_tokens"]


def test_assistant_prefill_is_continued(server):
    from mlxformer.generation.stream import stream_generate

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    prefill = "Sure: ban"
    reply = client.messages.create(model="claude-x", max_tokens=8, messages=[
        {"role": "user", "content": "Say the word."}, {"role": "assistant", "content": prefill}])
    text = server.hf.apply_chat_template([{"role": "user", "content": "Say the word."}], add_generation_prompt=True,
                                         tokenize=False) + prefill
    ids = server.hf(text, add_special_tokens=False)["input_ids"]
    expected = "".join(r.text for r in stream_generate(server.model, server.tokenizer, ids, 8))
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == len(ids)
    assert reply.content[0].text == expected and "<|im_start|>" not in expected


def test_strict_max_tokens_in_anthropic_words(server):
    client = anthropic.Anthropic(base_url=server.strict, api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="claude-x", max_tokens=10**6, messages=[{"role": "user", "content": "hi"}])
    # the pattern Claude Code's retry reads before lowering max_tokens
    match = re.search(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)",
                      caught.value.message)
    assert match and int(match[2]) == 10**6 and int(match[3]) == CONTEXT
    text = server.hf.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert int(match[1]) == len(server.hf(text, add_special_tokens=False)["input_ids"])
    ok = client.messages.create(model="claude-x", max_tokens=64, messages=[{"role": "user", "content": "hi"}])
    assert ok.content[0].text == WORD and ok.stop_reason == "end_turn"


def test_ping_events_while_waiting():
    """While no frame comes (a long prefill), the Messages stream sends Anthropic's own ``ping``
    event (which clients' idle timers count), not only an SSE comment."""
    import asyncio

    from mlxformer.server.anthropic_api import PING_EVENT
    from mlxformer.server.sse import keepalive

    async def slow():
        yield "event: message_start\ndata: {}\n\n"
        await asyncio.sleep(0.35)
        yield "event: message_stop\ndata: {}\n\n"

    async def run():
        return [chunk async for chunk in keepalive(slow(), 0.1, ping=PING_EVENT)]

    chunks = asyncio.run(run())
    assert chunks[0].startswith("event: message_start") and chunks[-1].startswith("event: message_stop")
    assert len(chunks) >= 4 and set(chunks[1:-1]) == {'event: ping\ndata: {"type": "ping"}\n\n'}


def test_anthropic_models_list_and_head(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].type == "model" and models.data[0].display_name == models.data[0].id
    assert http(server.url, "HEAD", "/")[0] == 200


def test_codex_request_is_served(server):
    status, _, raw = replay(server.url, "codex.json")
    assert status == 200, raw[:500]
    events = sse_events(raw)
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["output"][-1]["content"][0]["text"] == WORD
    assert final["warnings"] == ["the hosted tool 'web_search' is not available on this server and was ignored"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_opencode_request_is_served(server):
    status, _, raw = replay(server.url, "opencode.json")
    assert status == 200, raw[:500]
    chunks = sse_events(raw)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == WORD
    assert chunks[-1]["usage"]["completion_tokens"] == 3  # the word's two tokens and EOS


def test_namespace_tools_and_hosted_tool_choice(server):
    import openai

    body = json.loads((DATA / "codex.json").read_text())["body"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.responses.create(model="gpt-x", input="Spawn one.", tools=body["tools"], max_output_tokens=60,
                                    tool_choice={"type": "function", "name": "spawn_agent"})
    call = reply.output[0]
    assert call.type == "function_call", reply.model_dump_json()[:1500]
    assert call.type == "function_call" and call.name == "spawn_agent"
    assert call.model_dump().get("namespace") == "multi_agent_v1", call.model_dump()
    with pytest.raises(openai.BadRequestError, match="web_search"):
        client.responses.create(model="gpt-x", input="Search.", tools=body["tools"], tool_choice={"type": "web_search"})


def test_stored_responses_and_incomplete_items(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    cut = client.responses.create(model="gpt-x", input="Say it.", max_output_tokens=1, store=True)
    assert cut.status == "incomplete" and cut.output[0].status == "incomplete"
    again = client.responses.retrieve(cut.id)
    assert again.model_dump() == cut.model_dump()
    chained = client.responses.create(model="gpt-x", input="Again.", previous_response_id=cut.id)
    stateless = client.responses.create(model="gpt-x", input=[
        {"role": "user", "content": "Say it."}, {"role": "assistant", "content": cut.output_text},
        {"role": "user", "content": "Again."}])
    assert chained.usage.input_tokens == stateless.usage.input_tokens and chained.output_text == WORD
    assert chained.output[0].status == "completed"
    client.responses.delete(cut.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(cut.id)


def test_response_store_is_bounded_and_reasoning_sealed():
    from mlxformer.server.responses_state import ResponseStore, Stored, seal, unseal

    store = ResponseStore(limit=2)
    for name in "abc":
        store.put(name, Stored([], {"id": name}))
    store.get("b")
    store.put("d", Stored([], {"id": "d"}))
    assert list(store.items) == ["b", "d"]  # least recently used out
    value = seal("a thought")
    assert "a thought" not in value and unseal(value) == "a thought" and unseal("gAAAA-another-server") == ""


def metric(url: str, api: str, source: str) -> float:
    text = http(url, "GET", "/metrics")[2].decode()
    match = re.search(rf'^mlxformer_api_prompt_tokens_total{{api="{api}",source="{source}"}} (\S+)$', text, re.M)
    return float(match[1]) if match else 0.0


def test_claude_code_next_turn_is_cached(server):
    """Turn 2 of a Claude Code conversation (turn 1, its reply, a new user message; the billing
    header's per-request hash changed) takes all of turn 1's prompt from the prompt cache."""
    captured = json.loads((DATA / "claude_code.json").read_text())
    body = captured["body"]
    status, _, raw = http(server.url, "POST", captured["path"], body, captured["headers"], timeout=300)
    first = sse_events(raw.decode())
    turn1 = first[0]["message"]["usage"]["input_tokens"]
    before = {s: metric(server.url, "messages", s) for s in ("cached", "prefilled")}
    body["system"][0]["text"] = body["system"][0]["text"].rstrip(";") + "; cch=9f8e7;"
    body["messages"] += [{"role": "assistant", "content": [{"type": "text", "text": WORD}]},
                         {"role": "user", "content": [{"type": "text", "text": "And again?"}]}]
    status, _, raw = http(server.url, "POST", captured["path"], body, captured["headers"], timeout=300)
    assert status == 200
    delta = next(e for e in sse_events(raw.decode()) if e["type"] == "message_delta")
    cached, fresh = delta["usage"]["cache_read_input_tokens"], delta["usage"]["input_tokens"]
    assert cached >= turn1 - 64 and fresh < 0.05 * (cached + fresh)  # (cached in whole blocks)
    assert metric(server.url, "messages", "cached") - before["cached"] == cached
    assert metric(server.url, "messages", "prefilled") - before["prefilled"] == fresh


def test_force_tool_round_trip(server):
    """``serve --force-tool Bash``: a user turn offering Bash gets a Bash call; the turn that
    brings its result back gets the model's own answer."""
    client = anthropic.Anthropic(base_url=server.forcing, api_key="unused", max_retries=0, timeout=120)
    bash = {"name": "Bash", "description": "Run a command",
            "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
    other = {**bash, "name": "Read"}
    user = [{"role": "user", "content": "List the files."}]
    call = client.messages.create(model="claude-x", max_tokens=64, tools=[other, bash], messages=user,
                                  extra_body={"temperature": 0})
    assert [b.type for b in call.content] == ["tool_use"] and call.content[0].name == "Bash"
    assert call.stop_reason == "tool_use" and set(call.content[0].input) == {"command"}
    answer = client.messages.create(model="claude-x", max_tokens=64, tools=[other, bash], messages=[
        *user, {"role": "assistant", "content": [b.model_dump() for b in call.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.content[0].id, "content": "a.txt"}]}])
    assert answer.content[0].text == WORD and answer.stop_reason == "end_turn"
    unforced = client.messages.create(model="claude-x", max_tokens=64, tools=[other], messages=user)
    assert unforced.content[0].text == WORD  # Bash not offered: the model's own reply


def test_system_messages_merged_when_the_template_refuses_them():
    from mlxformer.server.turn import merge_system

    chat = [{"role": "system", "content": "A"}, {"role": "user", "content": "u"},
            {"role": "system", "content": "B"}, {"role": "assistant", "content": "a"}]
    assert merge_system(chat) == [{"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "u"},
                                  {"role": "assistant", "content": "a"}]
    assert merge_system(chat[:2]) is not None and merge_system(chat[:2]) == chat[:2]


def test_a_failed_responses_stream_ends_with_response_failed(server, monkeypatch):
    """A request that fails after its stream started (its detokenizer raising at the 2nd token):
    the official client reads OpenAI's ``error`` event, then ``response.failed`` with the error."""
    import openai

    made, calls = server.tokenizer.detokenizer, []

    class Failing:
        def __init__(self) -> None:
            self.inner, self.count = made(), 0

        def add_token(self, token: int) -> str:
            self.count += 1
            if self.count == 2:
                raise RuntimeError("injected detokenizer fault")
            return self.inner.add_token(token)

        def finalize(self) -> str:
            return self.inner.finalize()

    monkeypatch.setattr(server.tokenizer, "detokenizer", lambda: calls.append(1) or Failing())
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    events = list(client.responses.create(model="gpt-x", input="Say it.", max_output_tokens=8, stream=True))
    assert calls and [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.message == events[-2].message == "generation failed (RuntimeError)"
