"""The several-models server's memory bound (``MultiHost(max_memory=…)``, ``serve
--max-loaded-memory``): two tiny random Llamas whose weights plus KV budget fit the bound one at
a time alternate, each request unloading the other although ``max_loaded`` would keep both; a
bigger model that cannot fit even alone gets a 507 naming its sizes while the loaded one keeps
serving. References: the bytes of the loaded models' parameters (measured after ``load``) for
the estimate read from the checkpoint's headers, and the models' own config for the context
length and chat template that ``/v1/models`` reports before loading."""

from __future__ import annotations

import json

import pytest
from server_support import http

from conftest import write_byte_tokenizer, write_tiny_checkpoint, write_tiny_byte_llama
from mlxformer.server.runner import ServerThread

KV = 2**20  # each engine's KV budget (--max-kv-memory)
A, B, BIG = "a", "b", "big"
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def measured_weights(directory) -> int:
    """Bytes of the parameters of the model as ``load`` places it."""
    from mlx.utils import tree_flatten

    from mlxformer import load

    model, _ = load(directory, threads=1)
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@pytest.fixture(scope="module")
def bounded(tmp_path_factory):
    from types import SimpleNamespace

    from mlxformer.engine import Engine
    from mlxformer.loader import load
    from mlxformer.server.app import create_app
    from mlxformer.server.hosts import MultiHost
    from mlxformer.server.multi_app import several_models_app
    from mlxformer.server.translate import ServedModel

    dirs = {A: write_tiny_byte_llama(tmp_path_factory.mktemp("a"), seed=0),
            B: write_tiny_byte_llama(tmp_path_factory.mktemp("b"), seed=1)}
    (dirs[A] / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))  # B has none
    big = tmp_path_factory.mktemp("big")
    write_tiny_checkpoint(big, "llama", hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                          num_key_value_heads=2)
    write_byte_tokenizer(big)
    dirs[BIG] = big
    weights = {name: measured_weights(d) for name, d in dirs.items()}
    one = max(weights[A], weights[B]) + KV
    bound = one + min(weights[A], weights[B]) // 2  # fits either small model, not both
    assert weights[BIG] + KV > bound
    host: MultiHost | None = None

    def make_app(name, source):
        model, tokenizer = load(source, threads=1)
        engine = Engine(model, tokenizer, max_batch=2, max_kv_memory=KV)
        app = create_app(engine, ServedModel.of(name, model, tokenizer), host=lambda ctx: host)
        engine.start()
        return app, engine.stop

    host = MultiHost({name: str(d) for name, d in dirs.items()}, make_app, max_loaded=3, max_memory=bound,
                     max_kv_memory=KV)
    with ServerThread(several_models_app(host)) as server:
        yield SimpleNamespace(url=server.url, host=host, weights=weights, bound=bound, dirs=dirs)
    host.close()


def models(url: str) -> dict[str, dict]:
    status, _, body = http(url, "GET", "/v1/models")
    assert status == 200
    return {m["id"]: m for m in json.loads(body)["data"]}


def chat(url: str, model: str) -> tuple[int, dict]:
    status, _, body = http(url, "POST", "/v1/completions", {
        "model": model, "prompt": "Hi", "max_tokens": 2, "temperature": 0})
    return status, json.loads(body)


def test_models_not_loaded_show_context_length_and_capabilities(bounded):
    """Read from the checkpoint alone (nothing loads); equal to what the model shows once loaded."""
    listed = models(bounded.url)
    assert {n: m["state"] for n, m in listed.items()} == {A: "on disk", B: "on disk", BIG: "on disk"}
    for name, directory in bounded.dirs.items():
        config = json.loads((directory / "config.json").read_text())
        assert listed[name]["context_length"] == config["max_position_embeddings"]
    assert listed[A]["capabilities"]["chat"] is True and listed[B]["capabilities"]["chat"] is False
    assert listed[A]["capabilities"]["tools"] is True and listed[A]["capabilities"]["reasoning"] is False
    assert all(e.app is None for e in bounded.host.models.values())  # still nothing loaded
    before = {n: (m["context_length"], m["capabilities"]) for n, m in listed.items()}
    for name in (A, B):
        assert chat(bounded.url, name)[0] == 200
        loaded = models(bounded.url)[name]
        assert loaded["state"] == "loaded" and (loaded["context_length"], loaded["capabilities"]) == before[name]


def test_the_estimate_from_headers_is_the_loaded_weights(bounded):
    for name in (A, B, BIG):
        facts = bounded.host.facts(bounded.host.models[name])
        assert facts is not None and facts.weights == bounded.weights[name]


def test_models_that_fit_one_at_a_time_unload_each_other(bounded):
    for name, other in ((A, B), (B, A), (A, B)):
        status, reply = chat(bounded.url, name)
        assert status == 200 and reply["model"] == name, reply
        states = {n: m["state"] for n, m in models(bounded.url).items()}
        assert states[name] == "loaded" and states[other] == "on disk"  # max_loaded (3) alone would keep both


def test_a_model_too_big_even_alone_is_refused_with_its_sizes(bounded):
    assert chat(bounded.url, A)[0] == 200
    status, body = chat(bounded.url, BIG)
    assert status == 507 and body["error"]["code"] == "model_too_large", body
    message = body["error"]["message"]
    assert f"{(bounded.weights[BIG] + KV) / 2**20:.1f} MiB" in message
    assert f"weights {bounded.weights[BIG] / 2**20:.1f} MiB" in message
    assert f"--max-loaded-memory of {bounded.bound / 2**20:.1f} MiB" in message
    assert models(bounded.url)[A]["state"] == "loaded"  # nothing was unloaded for it
    status, reply = chat(bounded.url, A)
    assert status == 200 and reply["model"] == A


def test_serve_parses_the_bound():
    from mlxformer.engine.memory import device_memory, margin_for
    from mlxformer.errors import MlxformerError
    from mlxformer.server.model_facts import parse_loaded_memory

    assert parse_loaded_memory("1.5GiB") == 3 * 2**29
    assert parse_loaded_memory("auto") == device_memory() - margin_for(device_memory())
    with pytest.raises(MlxformerError, match="--max-loaded-memory"):
        parse_loaded_memory("lots")


def test_a_busy_model_is_not_unloaded_for_another(bounded):
    """While A's engine works on a request (its in-flight count), B does not fit beside it: 503
    with Retry-After, A stays loaded; once A is idle, B loads in its place."""
    assert chat(bounded.url, A)[0] == 200
    inflight = bounded.host.models[A].context.inflight
    inflight.count += 1  # a request of A's in flight
    try:
        status, headers, body = http(bounded.url, "POST", "/v1/completions", {"model": B, "prompt": "Hi", "max_tokens": 2})
        assert status == 503 and json.loads(body)["error"]["code"] == "model_memory_busy"
        assert headers["retry-after"] == "1"
        assert models(bounded.url)[A]["state"] == "loaded" and models(bounded.url)[B]["state"] == "on disk"
    finally:
        inflight.count -= 1
    assert chat(bounded.url, B)[0] == 200
    assert models(bounded.url)[A]["state"] == "on disk"
