"""The server under pressure, with one slot and a one-request queue: a client that disconnects
mid-stream (or mid-wait) frees its slot at once, a full queue answers 429 with an OpenAI error
body, and the server keeps serving afterwards."""

from __future__ import annotations

import json
import time
from http.client import HTTPConnection, HTTPResponse
from urllib.parse import urlsplit

import pytest
from server_support import error_of, http, load_for_engine, running_engine, running_server

LONG = 4000  # tokens: far more than a test could wait for, so only a cancel frees the slot
FREED_WITHIN_SECONDS = 60.0


@pytest.fixture(scope="module")
def server(smollm_gguf):
    model, tokenizer = load_for_engine(smollm_gguf)
    with running_engine(model, tokenizer, max_batch=1, max_queue=1) as engine:
        with running_server(engine, model, tokenizer) as url:
            yield url


def open_stream(url: str, max_tokens: int = LONG) -> tuple[HTTPConnection, HTTPResponse]:
    """Start a streamed chat request; returns once the response headers arrived."""
    parts = urlsplit(url)
    connection = HTTPConnection(parts.hostname, parts.port, timeout=120)
    body = {"messages": [{"role": "user", "content": "Count from one to one thousand."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    return connection, connection.getresponse()


def read_content_chunk(response: HTTPResponse) -> None:
    """Read SSE lines until one carries generated text."""
    for _ in range(1000):
        line = response.readline()
        assert line, "the stream ended early"
        if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
            return
    raise AssertionError("no content chunk")


def running(url: str) -> int:
    return json.loads(http(url, "GET", "/health")[2])["running"]


def wait_until_idle(url: str) -> float:
    start = time.monotonic()
    while running(url) and time.monotonic() - start < FREED_WITHIN_SECONDS:
        time.sleep(0.1)
    assert running(url) == 0
    return time.monotonic() - start


def short_reply_works(url: str) -> None:
    """A short request succeeds (a 429 is retried briefly: the engine frees a cancelled slot at its next step)."""
    deadline = time.monotonic() + FREED_WITHIN_SECONDS
    while True:
        status, _, raw = http(url, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0},
                              timeout=FREED_WITHIN_SECONDS)
        if status != 429 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] >= 1


def test_disconnect_mid_stream_frees_the_slot(server):
    connection, response = open_stream(server)
    assert response.status == 200
    read_content_chunk(response)
    connection.close()  # the client goes away mid-stream
    wait_until_idle(server)
    short_reply_works(server)  # with one slot, this only finishes if the long stream was cancelled


def test_disconnect_while_waiting_for_a_whole_reply_frees_the_slot(server):
    parts = urlsplit(server)
    connection = HTTPConnection(parts.hostname, parts.port, timeout=120)
    body = {"prompt": "Count from one to one thousand:", "max_tokens": LONG, "temperature": 0}
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    deadline = time.monotonic() + FREED_WITHIN_SECONDS
    while running(server) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    connection.close()
    wait_until_idle(server)
    short_reply_works(server)


def test_full_queue_gets_429_then_serving_resumes(server):
    opened: list[HTTPConnection] = []
    try:
        refused = None
        for _ in range(4):  # one running + one queued fit; a later one is refused
            connection, response = open_stream(server)
            opened.append(connection)
            if response.status != 200:
                refused = response
                break
            if len(opened) == 1:
                read_content_chunk(response)  # the first one is running
        assert refused is not None and refused.status in (429, 503)
        error = error_of(refused.read())
        assert error["code"] == "queue_full"
        assert len(opened) >= 2  # the queue did admit work before refusing
    finally:
        for connection in opened:
            connection.close()
    wait_until_idle(server)
    short_reply_works(server)
