"""The HTTP layer under abuse, on a tiny random llama with SmolLM2's real tokenizer (so decoding
costs milliseconds and what is measured is the server): a free event loop while huge bodies and
prompts are refused or tokenized, the body limit, the Host allow-list, the API key on the
OpenAPI document, CORS for the SDKs' headers, the waiting queue, and OpenAI's stream format."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.client import HTTPConnection
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from server_support import error_of, http, running_engine, running_server, served

CONTEXT = 8192  # SmolLM2's
MAX_GAP_SECONDS = 1.0


@pytest.fixture(scope="module")
def tiny(tiny_smol):
    """(model, tokenizer) of the tiny llama over SmolLM2's tokenizer (conftest's ``tiny_smol``)."""
    from mlxformer import load

    return load(tiny_smol[0], threads=1)


@pytest.fixture(scope="module")
def server(tiny):
    model, tokenizer = tiny
    with served(model, tokenizer, max_batch=4) as server:
        yield server


def no_eos(tokenizer) -> dict[str, float]:
    return {str(i): -100.0 for i in tokenizer.eos_token_ids}


def open_stream(url: str, body: dict) -> tuple[HTTPConnection, object]:
    parts = urlsplit(url)
    connection = HTTPConnection(parts.hostname, parts.port, timeout=60)
    connection.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                       {"Content-Type": "application/json"})
    return connection, connection.getresponse()


def post_raw(url: str, path: str, body_size: int) -> tuple[int, float]:
    """POST a ``body_size``-byte body on a raw socket; returns (status, seconds to the status line).
    The body is sent from another thread: the server may answer (and close) before reading it."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    head = (f"POST {path} HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {body_size}\r\n\r\n").encode()
    start = time.monotonic()

    def send_all() -> None:
        try:
            sock.sendall(head + b" " * body_size)
        except OSError:
            pass  # the server answered and closed

    sender = threading.Thread(target=send_all, daemon=True)
    sender.start()
    status_line = sock.makefile("rb").readline()
    elapsed = time.monotonic() - start
    sock.close()
    sender.join(timeout=10)
    return int(status_line.split()[1]), elapsed


def test_event_loop_stays_free_while_big_requests_are_refused_or_tokenized(server):
    """Done-when 3: a 10 MB body is a 413 within 1 s, and a concurrent stream's longest gap between
    chunks stays under 1 s while a 1 MB prompt is refused (by its length in characters) and a
    600 kB one (under that bound) is tokenized to be refused."""
    connection, response = open_stream(server.url, {"prompt": "Once upon a time", "max_tokens": 3000,
                                                    "temperature": 0, "logit_bias": no_eos(server.tokenizer)})
    arrivals: list[float] = []

    def read() -> None:
        try:
            for line in response:
                if line.startswith(b"data: {"):
                    arrivals.append(time.monotonic())
        except (OSError, AttributeError, ValueError):  # the test closed the connection
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while len(arrivals) < 20:
            time.sleep(0.01)
        window_start = time.monotonic()
        status, seconds = post_raw(server.url, "/v1/completions", 10 * 2**20)
        assert status == 413 and seconds < 1.0
        served = server.engine.tokenizer
        megabyte = "hello world, this is a test. " * 36_000  # 1 MB: more characters than 8192 tokens can hold
        started = time.monotonic()
        status, _, raw = http(server.url, "POST", "/v1/completions", {"prompt": megabyte, "max_tokens": 1})
        assert status == 400 and error_of(raw)["code"] == "context_length_exceeded"
        assert time.monotonic() - started < 1.0  # refused before tokenizing (which takes seconds)
        tokenized = "hello world, this is a test. " * 20_000  # 580 kB: within the bound, so it is tokenized
        assert len(tokenized) < CONTEXT * 81 and len(served.encode(tokenized[:2900])) * 200 > CONTEXT
        status, _, raw = http(server.url, "POST", "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": tokenized}], "max_tokens": 1})
        assert status == 400 and error_of(raw)["code"] == "context_length_exceeded"
        window_end = time.monotonic()
        time.sleep(0.3)
    finally:
        connection.close()
    during = [t for t in arrivals if window_start <= t <= window_end + 0.3]
    gaps = [b - a for a, b in zip(during, during[1:])]
    assert len(during) > 20 and max(gaps) < MAX_GAP_SECONDS, max(gaps)
    print(f"longest gap between chunks: {max(gaps):.3f} s over {len(during)} chunks")


def test_a_chunked_body_over_the_limit_is_413(server, tiny):
    model, tokenizer = tiny
    with running_server(server.engine, model, tokenizer, max_body_bytes=1000) as url:
        chunks = (b'{"prompt": "' + b"a" * 500 + b'"' for _ in range(1))
        status, _, raw = http(url, "POST", "/v1/completions", b"".join(chunks) + b" " * 2000 + b"}",
                              headers={"Content-Type": "application/json"})
        assert status == 413 and error_of(raw)["code"] == "request_too_large"
        parts = urlsplit(url)
        with httpx.Client() as client:  # no Content-Length: chunked transfer encoding
            reply = client.post(f"http://{parts.hostname}:{parts.port}/v1/completions",
                                content=iter([b'{"prompt": "' + b"a" * 800, b"a" * 800 + b'"}']),
                                headers={"Content-Type": "application/json"})
        assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
        assert http(url, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1})[0] == 200


def test_a_big_body_sent_whole_gets_its_413(server, tiny):
    """http.client writes the whole 12 MB body before it reads: it must see the 413, not a reset."""
    parts = urlsplit(server.url)
    connection = HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        connection.request("POST", "/v1/completions", b"{" + b" " * (12 * 2**20) + b"}",
                           {"Content-Type": "application/json"})
        reply = connection.getresponse()
        assert reply.status == 413 and json.loads(reply.read())["error"]["code"] == "request_too_large"
    finally:
        connection.close()


def test_metrics_label_routes_by_their_template(server):
    """300 distinct ``/v1/models/{id}`` paths are one series, not 300."""
    for i in range(300):
        assert http(server.url, "GET", f"/v1/models/no-such-model-{i}")[0] == 404
    status, _, raw = http(server.url, "GET", "/metrics")
    series = [line for line in raw.decode().splitlines() if line.startswith("mlxformer_http_requests_total{")]
    assert status == 200 and not any("no-such-model" in line for line in series)
    assert any('route="/v1/models/{model_id:path}"' in line and 'status="404"' in line and line.endswith(" 300.0")
               for line in series), series


def test_host_header_allow_list(server, tiny):
    from mlxformer.server.runner import served_hosts

    for host in ("attacker.example", "attacker.example:80", "127.0.0.1.attacker.example", "localhost.example"):
        status, _, raw = http(server.url, "GET", "/v1/models", headers={"Host": host})
        assert status == 403 and error_of(raw)["code"] == "host_not_allowed", host
    status, _, raw = http(server.url, "GET", "/health", headers={"Host": "attacker.example"})
    assert status == 403  # every route, not only /v1
    port = urlsplit(server.url).port
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "LOCALHOST", f"[::1]:{port}"):
        assert http(server.url, "GET", "/v1/models", headers={"Host": host})[0] == 200, host
    assert served_hosts("0.0.0.0", []) is None  # not loopback: any name (the operator picked the exposure)
    hosts = served_hosts("127.0.0.1", ["box.lan"])
    assert {"127.0.0.1", "localhost", "box.lan"} <= hosts and "attacker.example" not in hosts
    model, tokenizer = tiny
    with running_server(server.engine, model, tokenizer, allowed_hosts=sorted(hosts)) as url:
        assert http(url, "GET", "/v1/models", headers={"Host": "box.lan:8080"})[0] == 200


def test_guard_errors_on_the_messages_routes_are_anthropic_shaped(server, tiny):
    """The Host check and the body limit answer before routing, in the shape of the route's API
    (the OpenAPI document declares Anthropic's error body for every status of /v1/messages)."""
    import anthropic

    status, _, raw = http(server.url, "POST", "/v1/messages", {"model": "m"}, headers={"Host": "attacker.example"})
    assert status == 403 and json.loads(raw)["type"] == "error", raw
    model, tokenizer = tiny
    with running_server(server.engine, model, tokenizer, max_body_bytes=100) as url:
        client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as caught:
            client.messages.create(model="m", max_tokens=1, messages=[{"role": "user", "content": "Hi " * 50}])
        assert caught.value.status_code == 413 and caught.value.body["error"]["type"] == "request_too_large"
        status, _, raw = http(url, "POST", "/v1/completions", {"prompt": "Hi " * 50})
        assert status == 413 and error_of(raw)["code"] == "request_too_large"


def test_responses_json_schema_format_without_a_schema_is_a_400(server):
    """Found by schemathesis's coverage phase: it was a 500 (the format was only checked when
    translated to the chat format, after validation)."""
    for fmt in ({"type": "json_schema", "name": "x"}, {"type": "json_schema", "schema": None}):
        status, _, raw = http(server.url, "POST", "/v1/responses", {"input": "Hi", "text": {"format": fmt}})
        assert status == 400 and error_of(raw)["param"] == "text", raw


OVERFLOWING = {"anyOf": [{"type": "object", "properties": {k: {"type": "integer"}}, "required": [k]} for k in "abcdefghijklmnopqrst"]}


@pytest.fixture
def tight_matcher(monkeypatch):
    """llguidance limits under which ``OVERFLOWING`` compiles but its first mask overflows the
    matcher ("Too many items"). With llguidance's defaults (50,000 Earley items per step) that
    takes a schema of some 12,000 optional properties (about 20 s to compile), so the test
    lowers the limit instead: the error is llguidance's own, at the same step."""
    import llguidance

    from mlxformer.constrained import matcher

    monkeypatch.setattr(matcher, "PARSER_LIMITS", llguidance.LLParserLimits(step_max_items=10))


def test_a_schema_overflowing_the_matcher_at_its_first_mask_is_a_400_on_every_api(server, tight_matcher, caplog):
    """Chat, completions, Responses and Messages: a 400 naming the format, a short message, nothing
    logged (it was a 500, or a failure after the stream began, with the matcher's whole report)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": OVERFLOWING}}
    hi = [{"role": "user", "content": "Hi"}]
    for path, body in [
        ("/v1/chat/completions", {"messages": hi, "response_format": fmt}),
        ("/v1/chat/completions", {"messages": hi, "response_format": fmt, "stream": True}),
        ("/v1/completions", {"prompt": "Hi", "response_format": fmt}),
        ("/v1/responses", {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": OVERFLOWING}}}),
        ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": hi,
                          "output_config": {"format": {"type": "json_schema", "schema": OVERFLOWING}}}),
    ]:
        status, _, raw = http(server.url, "POST", path, body)
        assert status == 400, (path, raw)
        error = json.loads(raw)["error"]
        assert "Too many items" in error["message"] and len(error["message"]) < 600, error
    assert not [r for r in caplog.records if len(r.getMessage()) > 1000]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="smollm2-test", messages=hi, max_tokens=8, stream=stream,
                                           response_format=fmt)
        assert caught.value.body["param"] == "response_format" and "Too many items" in caught.value.body["message"]
    plain = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}
    status, _, raw = http(server.url, "POST", "/v1/completions", {"prompt": "n=", "response_format": plain, "max_tokens": 4})
    assert status == 200 and json.loads(raw)["choices"][0]["text"].strip().lstrip("-").isdigit(), raw


def test_openapi_document_behind_the_key_or_off(server, tiny):
    model, tokenizer = tiny
    with running_server(server.engine, model, tokenizer, api_key="k3y") as url:
        status, _, raw = http(url, "GET", "/openapi.json")
        assert status == 401 and error_of(raw)["type"] == "authentication_error"
        status, _, raw = http(url, "GET", "/openapi.json", headers={"Authorization": "Bearer k3y"})
        assert status == 200 and "/v1/chat/completions" in json.loads(raw)["paths"]
        for method, path, body in (("GET", "/api/tags", None), ("GET", "/metrics", None),
                                   ("POST", "/tokenize", {"content": "Hi"})):  # every API route, as documented
            assert http(url, method, path, body)[0] == 401, path
            assert http(url, method, path, body, headers={"Authorization": "Bearer k3y"})[0] == 200, path
        assert http(url, "GET", "/health")[0] == 200  # a load balancer's probe needs no key
    with running_server(server.engine, model, tokenizer, openapi=False) as url:
        assert http(url, "GET", "/openapi.json")[0] == 404


def test_cors_preflight_allows_the_sdk_headers(server, tiny):
    """The headers the official openai client really sends (captured from its request) pass a preflight."""
    sent: list[httpx.Headers] = []
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0,
                           http_client=httpx.Client(event_hooks={"request": [lambda r: sent.append(r.headers)]}))
    client.models.list()
    names = sorted({n.lower() for n in sent[0]} - {"host", "accept", "accept-encoding", "connection", "user-agent",
                                                    "content-length"})
    assert any(n.startswith("x-stainless-") for n in names)
    model, tokenizer = tiny
    with running_server(server.engine, model, tokenizer, cors_origins=["http://app.example"]) as url:
        preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": ",".join([*names, "content-type"])}
        status, headers, raw = http(url, "OPTIONS", "/v1/chat/completions", headers=preflight)
        assert status == 200, raw
        assert headers["access-control-allow-origin"] == "http://app.example"


def test_served_model_id_is_a_name_not_a_path(smollm_gguf, tmp_path):
    from mlxformer.cli.serve import model_name

    assert model_name(str(smollm_gguf)) == smollm_gguf.stem
    assert model_name(str(tmp_path)) == tmp_path.name and "/" not in model_name(str(tmp_path) + "/")
    assert model_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_max_queue_zero_admits_free_slots_and_429s_the_rest(tiny):
    model, tokenizer = tiny
    long = {"prompt": "Once", "max_tokens": 4000, "temperature": 0, "logit_bias": no_eos(tokenizer)}
    with running_engine(model, tokenizer, max_batch=2, max_queue=0) as engine:
        with running_server(engine, model, tokenizer) as url:
            first, second = open_stream(url, long), open_stream(url, long)  # back to back: both have a slot
            try:
                assert first[1].status == 200 and second[1].status == 200
                status, headers, raw = http(url, "POST", "/v1/completions", long)
                assert status == 429 and error_of(raw)["code"] == "queue_full"
                assert int(headers["retry-after"]) >= 1
            finally:
                first[0].close()
                second[0].close()


def sse_objects(raw: bytes) -> list[dict]:
    lines = [line[6:] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_stream_chunks_follow_openai_format(server):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "logit_bias": no_eos(server.tokenizer)}
    status, _, raw = http(server.url, "POST", "/v1/chat/completions", body)
    assert status == 200
    chunks = sse_objects(raw)
    assert len({c["created"] for c in chunks}) == 1
    choices = [c for c in chunks if c["choices"]]
    for chunk in choices[:-1]:
        assert chunk["choices"][0]["finish_reason"] is None and "finish_reason" in chunk["choices"][0]
        assert "usage" in chunk and chunk["usage"] is None
    assert choices[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 40
    body.pop("stream_options")
    chunks = sse_objects(http(server.url, "POST", "/v1/completions", {**body, "prompt": "Hi", "messages": None})[2])
    assert all("usage" not in c for c in chunks) and chunks[0]["choices"][0]["finish_reason"] is None


def test_prompt_fidelity(server):
    status, _, raw = http(server.url, "POST", "/v1/completions", {"prompt": "", "max_tokens": 2})
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 2
    for stream in (False, True):
        status, _, raw = http(server.url, "POST", "/v1/completions",
                              {"prompt": "Hello there", "max_tokens": 0, "echo": True, "stream": stream})
        assert status == 200, raw
        choices = [c["choices"][0] for c in sse_objects(raw)] if stream else json.loads(raw)["choices"]
        assert "".join(c["text"] for c in choices) == "Hello there" and choices[-1]["finish_reason"] == "length"
    assert json.loads(raw.split(b"data: ")[1])["choices"][0]["text"] == "Hello there"
    for bad, param in [
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"logprobs": True, "top_logprobs": False}, "top_logprobs"),
        ({"max_tokens": True}, "max_tokens"),
        ({"stream": 1}, "stream"),
        ({"logprobs": 1}, "logprobs"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"max_tokens": CONTEXT}, "max_tokens"),
    ]:
        body = {"messages": [{"role": "user", "content": "Hi"}], **bad}
        status, _, raw = http(server.url, "POST", "/v1/chat/completions", body)
        assert status == 400 and error_of(raw)["param"] == param, (bad, raw)
    body = b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}'
    status, _, raw = http(server.url, "POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    assert status == 400 and error_of(raw)["param"] == "temperature"
    from mlxformer.server.translate import ServedModel, completion_budget

    served = ServedModel.of("tiny", server.model, server.tokenizer)
    assert completion_budget(10, None, served, "prompt") == CONTEXT - 10  # no max_tokens: the rest of the context


def test_validation_in_one_place_every_bound_a_400_naming_its_field(server):
    """Values go through mlxformer.sampling.options.SamplingSettings (the library's one validation): each bad
    one is a 400 whose param is the API's field name; NaN and infinities in any float too."""
    hi = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    for field, value in [("seed", -2), ("seed", 2**64), ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5),
                         ("min_p", 1.0), ("top_k", -2), ("presence_penalty", 2.5), ("frequency_penalty", -3),
                         ("repetition_penalty", 0), ("logit_bias", {"5": 101}), ("logit_bias", {"-1": 1}),
                         ("logit_bias", {"x": 1}), ("logit_bias", {str(10**7): 1})]:
        status, _, raw = http(server.url, "POST", "/v1/chat/completions", {**hi, field: value})
        assert status == 400 and error_of(raw)["param"] == field, (field, value, raw)
    for field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        for literal in ("NaN", "Infinity", "-Infinity"):
            body = json.dumps(hi)[:-1] + f', "{field}": {literal}}}'
            status, _, raw = http(server.url, "POST", "/v1/chat/completions", body.encode(),
                                  {"Content-Type": "application/json"})
            assert status == 400 and error_of(raw)["param"] == field, (field, literal, raw)
    body = json.dumps(hi)[:-1] + ', "logit_bias": {"5": NaN}}'
    status, _, raw = http(server.url, "POST", "/v1/chat/completions", body.encode(), {"Content-Type": "application/json"})
    assert status == 400 and error_of(raw)["param"] == "logit_bias"
    for seed in (-1, 0, 2**64 - 1):  # -1: random (llama.cpp); up to what mx.random.key takes
        status, _, raw = http(server.url, "POST", "/v1/chat/completions", {**hi, "seed": seed, "stream": True})
        assert status == 200 and b'"error"' not in raw, (seed, raw)


def test_malformed_earlier_turns_are_400s_not_500s(server):
    """An assistant ``tool_call`` whose ``function`` is a string, and a Responses reasoning item
    with a non-text part: the request's fault, so a 400 in the API's shape."""
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": "get_weather"}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    status, _, raw = http(server.url, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert status == 400 and error_of(raw)["type"] == "invalid_request_error", raw
    items = [{"type": "reasoning", "summary": [], "content": [{"type": "input_image", "image_url": "x"}]},
             {"role": "user", "content": "Hi"}]
    status, _, raw = http(server.url, "POST", "/v1/responses", {"input": items, "max_output_tokens": 1})
    assert status == 400 and error_of(raw)["param"] == "input", raw
    for nothing in ([], [{}], [{"type": "message", "role": "user"}]):  # no turn, an item that is nothing, no content
        status, _, raw = http(server.url, "POST", "/v1/responses", {"input": nothing, "max_output_tokens": 1})
        assert status == 400 and error_of(raw)["param"] == "input", (nothing, raw)
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]
    status, _, raw = http(server.url, "POST", "/v1/chat/completions",
                          {"messages": [*messages[:1], {"role": "assistant", "tool_calls": calls}, messages[2]],
                           "max_tokens": 1})
    assert status == 200, raw
