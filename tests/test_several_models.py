"""Several models in one server (``MultiHost`` behind ``several_models_app``): the real SmolLM2
GGUF and a tiny random Llama alternate, each reply equal to ``generate`` alone on that model;
``/v1/models``, ``/api/tags``, ``/api/ps`` and ``/metrics`` show which are loaded; ``keep_alive: 0``
unloads after the reply, an idle keep-alive unloads in the background; a model that fails to
load gets a 500 naming the reason while the others keep serving; no model object outlives its
unload (the memory it returns is measured on a subprocess server: ``test_unload_memory.py``)."""

from __future__ import annotations

import json
import time

import anthropic
import ollama
import pytest
from server_support import http

from mlxformer.server.runner import ServerThread

SMOL, TINY, BROKEN = "smol", "tiny", "broken"


@pytest.fixture(scope="module")
def several(smollm_gguf, tiny_smol, tmp_path_factory):
    from types import SimpleNamespace

    from mlxformer.engine import Engine
    from mlxformer.loader import load
    from mlxformer.server.app import create_app
    from mlxformer.server.hosts import MultiHost
    from mlxformer.server.multi_app import several_models_app
    from mlxformer.server.translate import ServedModel

    broken = tmp_path_factory.mktemp("broken")
    (broken / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    host: MultiHost | None = None
    loaded_models: list = []  # weak references to every model loaded

    def make_app(name, source):
        import weakref

        model, tokenizer = load(source, threads=1)
        loaded_models.append((name, weakref.ref(model)))
        engine = Engine(model, tokenizer, max_batch=2)
        app = create_app(engine, ServedModel.of(name, model, tokenizer), host=lambda ctx: host)
        engine.start()
        return app, engine.stop

    host = MultiHost({SMOL: str(smollm_gguf), TINY: str(tiny_smol[0]), BROKEN: str(broken)}, make_app, max_loaded=2)
    with ServerThread(several_models_app(host)) as server:
        yield SimpleNamespace(url=server.url, host=host, smollm_gguf=smollm_gguf, tiny=tiny_smol[0],
                              loaded=loaded_models)
    host.close()


def states(url: str) -> dict[str, str]:
    status, _, body = http(url, "GET", "/v1/models")
    assert status == 200
    return {m["id"]: m["state"] for m in json.loads(body)["data"]}


def chat(url: str, model: str, **extra) -> tuple[int, dict]:
    status, _, body = http(url, "POST", "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4, "temperature": 0,
        **extra})
    return status, json.loads(body)


def reference(source, max_tokens: int = 4) -> str:
    from mlxformer import load
    from mlxformer.generation.stream import stream_generate

    model, tokenizer = load(source, threads=1)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}])
    ids = tokenizer.encode(text, add_special_tokens=False)
    return "".join(r.text for r in stream_generate(model, tokenizer, ids, max_tokens))


def test_models_alternate_and_keep_alive_unloads(several):
    assert states(several.url) == {SMOL: "on disk", TINY: "on disk", BROKEN: "on disk"}
    expected = {SMOL: reference(several.smollm_gguf), TINY: reference(several.tiny)}
    for name in (TINY, SMOL, TINY, SMOL):
        status, reply = chat(several.url, name)
        assert status == 200, reply
        assert reply["model"] == name and reply["choices"][0]["message"]["content"] == expected[name]
    assert states(several.url) == {SMOL: "loaded", TINY: "loaded", BROKEN: "on disk"}
    client = ollama.Client(host=several.url, timeout=300)
    assert [m.model for m in client.list().models] == [SMOL, TINY, BROKEN]
    assert sorted(m.model for m in client.ps().models) == [SMOL, TINY]
    reply = client.chat(model=TINY, messages=[{"role": "user", "content": "Hi there"}],
                        options={"temperature": 0, "num_predict": 4}, keep_alive=0)
    assert reply.message.content == expected[TINY]
    assert states(several.url)[TINY] == "on disk"  # unloaded after the reply
    status, _, body = http(several.url, "GET", "/metrics")
    assert f'mlxformer_model_loaded{{model="{TINY}"}} 0' in body.decode()
    assert f'mlxformer_model_loaded{{model="{SMOL}"}} 1' in body.decode()
    status, _, body = http(several.url, "GET", f"/metrics?model={SMOL}")
    assert status == 200 and b"mlxformer_http_requests" in body


def test_a_model_that_fails_to_load_names_the_reason_and_others_keep_serving(several):
    status, body = chat(several.url, BROKEN)
    assert status == 500 and body["error"]["code"] == "model_load_failed"
    assert body["error"]["message"].startswith(f"the model '{BROKEN}' failed to load: ")
    with pytest.raises(ollama.ResponseError) as error:
        ollama.Client(host=several.url).chat(model=BROKEN, messages=[{"role": "user", "content": "Hi"}])
    assert error.value.status_code == 500 and "failed to load" in error.value.error
    status, reply = chat(several.url, SMOL)
    assert status == 200 and reply["model"] == SMOL
    status, body = chat(several.url, "nobody")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    # the Messages routes answer in Anthropic's form, as the official client reads it
    client = anthropic.Anthropic(base_url=several.url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Hi"}]
    for call in (lambda: client.messages.create(model="nobody", max_tokens=4, messages=messages),
                 lambda: client.messages.count_tokens(model="nobody", messages=messages)):
        with pytest.raises(anthropic.NotFoundError) as missing:
            call()
        assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"
        assert "'nobody' does not exist" in missing.value.body["error"]["message"]


def test_idle_keep_alive_unloads_and_frees_the_model(several):
    """An idle keep-alive unloads the model, and no model object outlives its unload (this
    process's RSS says nothing of it: its heap holds what earlier tests freed)."""
    import gc

    several.host.unload(SMOL)
    several.host.unload(TINY)
    status, _ = chat(several.url, SMOL, keep_alive="1s")
    assert status == 200
    deadline = time.monotonic() + 30
    while states(several.url)[SMOL] == "loaded" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert states(several.url)[SMOL] == "on disk"
    while any(model() is not None for _, model in several.loaded) and time.monotonic() < deadline:
        time.sleep(0.2)  # the unload finishes freeing
    gc.collect()
    assert [(i, name) for i, (name, model) in enumerate(several.loaded) if model() is not None] == []  # all freed


def test_serve_flags_name_the_models(tmp_path):
    """``serve``'s --model (repeated) and --models-dir: one served name per model; split GGUF
    parts after the first and mmproj files are no models."""
    from mlxformer.cli.main import build_parser
    from mlxformer.cli.serve import model_sources

    for name in ("a-Q4_0.gguf", "b-00001-of-00002.gguf", "b-00002-of-00002.gguf", "mmproj-a.gguf", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    args = build_parser().parse_args(["serve", "--model", "org/repo:Q8_0", "--models-dir", str(tmp_path)])
    assert model_sources(args) == {"org/repo:Q8_0": "org/repo:Q8_0", "a-Q4_0": str(tmp_path / "a-Q4_0.gguf"),
                                   "b-00001-of-00002": str(tmp_path / "b-00001-of-00002.gguf"),
                                   "folder": str(tmp_path / "folder")}
    args = build_parser().parse_args(["serve", "-m", "x.gguf", "-m", "y"])
    assert list(model_sources(args)) == ["x.gguf", "y"]


def test_no_model_loads_for_a_request_the_guards_refuse():
    """A missing API key (401), a foreign ``Host`` (403) and a body past ``--max-body-bytes``,
    declared or streamed in chunks (413), are answered before any model loads; with the key the
    model loads and answers. The errors keep each API's shape."""
    from http.client import HTTPConnection
    from types import SimpleNamespace
    from urllib.parse import urlsplit

    from fastapi import FastAPI

    from mlxformer.server.hosts import MultiHost
    from mlxformer.server.multi_app import several_models_app

    loads: list[str] = []

    def make_app(name, source):  # a stand-in for a model's app: only whether it loads matters here
        loads.append(name)
        app = FastAPI()
        app.state.context = SimpleNamespace(inflight=SimpleNamespace(count=0))
        app.post("/v1/chat/completions")(lambda: {"served": name})
        return app, lambda: None

    host = MultiHost({"a": "unused", "b": "unused"}, make_app, max_loaded=2)
    request = {"model": "a", "messages": [{"role": "user", "content": "Hi"}]}
    key = {"Authorization": "Bearer sekret"}
    with ServerThread(several_models_app(host, api_key="sekret", max_body_bytes=2000)) as server:
        status, _, body = http(server.url, "POST", "/v1/chat/completions", request)
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        status, _, body = http(server.url, "POST", "/v1/messages", {**request, "max_tokens": 4})
        assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
        status, _, _ = http(server.url, "POST", "/v1/chat/completions", {**request, "model": "b"},
                            {**key, "Host": "evil.example"})
        assert status == 403
        big = {**request, "user": "x" * 5000}
        assert http(server.url, "POST", "/v1/chat/completions", big, key)[0] == 413
        parts = urlsplit(server.url)
        connection = HTTPConnection(parts.hostname, parts.port, timeout=60)
        chunks = iter([json.dumps(big).encode()[i:i + 500] for i in range(0, 5200, 500)])
        connection.request("POST", "/v1/chat/completions", body=chunks, encode_chunked=True,
                           headers={**key, "Content-Type": "application/json"})
        assert connection.getresponse().status == 413
        connection.close()
        assert loads == []
        status, _, body = http(server.url, "POST", "/v1/chat/completions", request, {"x-api-key": "sekret"})
        assert (status, json.loads(body), loads) == (200, {"served": "a"}, ["a"])
    host.close()
