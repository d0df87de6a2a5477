"""The streaming watchdogs: during a prefill longer than the clients' idle (read) timeout, the
official clients (the ``anthropic`` SDK on Messages, the ``openai`` SDK on Chat Completions and
on Responses) receive events before the first token and complete without retrying.

The engine prefills in small chunks, each slowed by a sleep on the engine's thread, so a long
prompt takes several idle timeouts to prefill; every byte each client receives is timed by its
own HTTP transport. The control: with the keep-alive interval above the timeout, each client
times out during the same prefill (the prefill is long enough to trip its timer)."""

from __future__ import annotations

import json
import re
import time
from types import SimpleNamespace
from typing import Any, Iterator

import anthropic
import httpx2 as httpx  # the SDKs' HTTP client (the `httpx` fork both now use)
import openai
import pytest
from server_support import MODEL_NAME, http, running_engine, running_server
from word_model import WORD, write_word_model

IDLE_TIMEOUT = 1.5  # the clients' read timeout: seconds without a byte
PING_SECONDS = 0.3  # the server's keep-alive interval, well under the timeout
PREFILL_CHUNK = 32
CHUNK_SECONDS = 0.3  # each prompt chunk's delay: 16 chunks take 4.8 s
PROMPT_WORDS = 500  # ~510 tokens with the template: 16 chunks
ROUTES = {"messages": "/v1/messages", "chat": "/v1/chat/completions", "responses": "/v1/responses"}


@pytest.fixture(scope="module")
def server(hf_smollm_tokenizer, tmp_path_factory):
    from mlxformer import load

    directory = tmp_path_factory.mktemp("word_model")
    write_word_model(directory, hf_smollm_tokenizer, context=4096)
    model, tokenizer = load(directory, threads=1)
    # one chunk a step, so that each chunk is one (slowed) prefill call
    with running_engine(model, tokenizer, max_batch=1, prefill_chunk=PREFILL_CHUNK, step_tokens=PREFILL_CHUNK) as engine:
        calls: list[tuple[float, float, bool]] = []  # each prompt chunk's (start, end, last)
        prefill = engine.runner.prefill

        def slow_prefill(tokens: Any, cache: Any, want_logits: bool, *args: Any) -> Any:
            start = time.monotonic()
            time.sleep(CHUNK_SECONDS)
            out = prefill(tokens, cache, want_logits, *args)
            calls.append((start, time.monotonic(), want_logits))
            return out

        engine.runner.prefill = slow_prefill  # the engine thread looks it up at each chunk
        with running_server(engine, model, tokenizer, sse_ping_seconds=PING_SECONDS) as url:
            with running_server(engine, model, tokenizer, sse_ping_seconds=10 * IDLE_TIMEOUT) as late:
                yield SimpleNamespace(url=url, late=late, calls=calls)


class Timed(httpx.SyncByteStream):
    """A response body whose every chunk is recorded with its arrival time."""

    def __init__(self, inner: httpx.SyncByteStream, received: list[tuple[float, bytes]]) -> None:
        self.inner, self.received = inner, received

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.inner:
            self.received.append((time.monotonic(), chunk))
            yield chunk

    def close(self) -> None:
        self.inner.close()


class Recording(httpx.BaseTransport):
    """httpx's own transport, counting the requests sent and timing the bytes received."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.requests, self.sent = 0, 0.0
        self.received: list[tuple[float, bytes]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.requests, self.sent = self.requests + 1, time.monotonic()
        response = self.inner.handle_request(request)
        return httpx.Response(response.status_code, headers=response.headers,
                              stream=Timed(response.stream, self.received), extensions=response.extensions)

    def events(self) -> list[tuple[float, str, bytes]]:
        """Each SSE frame as ``(arrival, name, frame)``: the ``event:`` name, else ``data``, or
        ``comment`` for a comment-only frame."""
        out, buffer = [], b""
        for arrival, chunk in self.received:
            buffer += chunk
            while b"\n\n" in buffer:
                frame, buffer = buffer.split(b"\n\n", 1)
                named = re.match(rb"event: (\S+)", frame)
                name = named[1].decode() if named else "data" if b"\ndata:" in b"\n" + frame else "comment"
                out.append((arrival, name, frame))
        return out


def completed_requests(url: str, route: str) -> dict[str, float]:
    """The server's response count for ``route``, by status (its ``/metrics``)."""
    text = http(url, "GET", "/metrics")[2].decode()
    pattern = rf'mlxformer_http_requests_total\{{route="{re.escape(route)}",status="(\d+)"\}} (\S+)'
    return {status: float(count) for status, count in re.findall(pattern, text)}


def timeout() -> httpx.Timeout:
    return httpx.Timeout(30.0, read=IDLE_TIMEOUT)


def stream(api: str, url: str, transport: Recording, tag: str) -> str:
    """One streamed request on ``api`` with its official client (no retries); the reply's text."""
    prompt = f"{tag} " + "word " * PROMPT_WORDS  # a new first token: no prompt cache hit
    http_client = httpx.Client(transport=transport)
    if api == "messages":
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=timeout(),
                                     http_client=http_client)
        events = client.messages.create(model="claude-x", max_tokens=16, stream=True,
                                        messages=[{"role": "user", "content": prompt}])
        return "".join(e.delta.text for e in events if e.type == "content_block_delta")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout(),
                           http_client=http_client)
    if api == "chat":
        chunks = client.chat.completions.create(model=MODEL_NAME, max_tokens=16, stream=True,
                                                messages=[{"role": "user", "content": prompt}])
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    events = list(client.responses.create(model=MODEL_NAME, max_output_tokens=16, stream=True, input=prompt))
    assert events[-1].type == "response.completed"
    return events[-1].response.output_text


# the events each API must send before its first token, and the name of a token's event
EARLY = {"messages": (["message_start", "ping"], "content_block_delta"),
         "chat": (["data"], "data"),
         "responses": (["response.created", "response.in_progress"], "response.output_text.delta")}


def has_text(api: str, frame: bytes) -> bool:
    """Whether a token event carries text (a chat chunk's delta may be the role alone)."""
    if api != "chat":
        return True
    data = json.loads(frame.split(b"data: ", 1)[1])
    return bool(data["choices"] and data["choices"][0]["delta"].get("content"))


@pytest.mark.parametrize("api", list(ROUTES))
def test_events_during_a_long_prefill_and_no_retry(server, api):
    route = ROUTES[api]
    before = completed_requests(server.url, route)
    transport = Recording()
    assert stream(api, server.url, transport, f"{api}-{time.time_ns()}") == WORD  # no timeout error
    calls = [c for c in server.calls if c[0] >= transport.sent]
    prefill_start, prefill_end = calls[0][0], next(end for _, end, last in calls if last)
    assert prefill_end - prefill_start > 3 * IDLE_TIMEOUT  # the premise: a prefill of several timeouts
    # one request sent by the client, one answered by the server (200): no retry
    assert transport.requests == 1
    after = completed_requests(server.url, route)
    assert {s: after[s] - before.get(s, 0) for s in after if after[s] != before.get(s, 0)} == {"200": 1}

    events = transport.events()
    early, token = EARLY[api]
    first_token = next(i for i, (_, name, frame) in enumerate(events) if name == token and has_text(api, frame))
    names = [name for _, name, _ in events[:first_token]]
    assert names[:len(early)] == early, names[:5]
    assert events[0][0] < prefill_start + IDLE_TIMEOUT  # the opening frames at admission
    # during the prefill, something at least every keep-alive interval (with room for a busy machine)
    during = [arrival for arrival, _, _ in events[:first_token]]
    gaps = [b - a for a, b in zip([transport.sent, *during], [*during, prefill_end])]
    assert max(gaps) < IDLE_TIMEOUT / 2, gaps
    if api == "messages":  # Anthropic's own ping events (which Claude Code's watchdog counts), not comments
        assert names.count("ping") >= 2 and "comment" not in names


@pytest.mark.parametrize("api", list(ROUTES))
def test_clients_time_out_without_keepalive(server, api):
    """The control: the same prefill with the keep-alive interval above the clients' timeout."""
    # before the response's headers the SDK's own error, while reading the stream httpx's
    errors = (anthropic.APITimeoutError if api == "messages" else openai.APITimeoutError, httpx.ReadTimeout)
    transport = Recording()
    with pytest.raises(errors):
        stream(api, server.late, transport, f"late-{api}-{time.time_ns()}")
    assert IDLE_TIMEOUT <= time.monotonic() - transport.sent < 3 * IDLE_TIMEOUT and transport.requests == 1
    early = EARLY[api][0]
    assert [name for _, name, _ in transport.events()][:len(early)] == early  # admitted, then silence
