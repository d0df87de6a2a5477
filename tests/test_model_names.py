"""Issue 44: one model-name rule for every route. A one-model server serves any name it is sent
(apps hard-code ``gpt-4o``, Claude Code sends ``claude-*``, Ollama's clients a ``name:tag``) on
Chat Completions, Completions, Responses, Anthropic Messages (and its token count) and Ollama's
chat, generate and show, each through its official client (before: Chat Completions and
Completions answered 404 "the model 'gpt-4o' does not exist"); with strict names
(``--strict-model-names``) every one of them answers a foreign name with a 404 in its API's
shape, and the served name as before."""

from __future__ import annotations

from types import SimpleNamespace

import anthropic
import ollama
import openai
import pytest
from server_support import MODEL_NAME, running_engine, running_server

FOREIGN = "gpt-4o"
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def servers(tiny_smol):
    from mlxformer import load

    model, tokenizer = load(tiny_smol[0], threads=1)
    with running_engine(model, tokenizer, max_batch=2) as engine:
        with running_server(engine, model, tokenizer) as url, \
                running_server(engine, model, tokenizer, any_model_name=False) as strict:
            yield SimpleNamespace(url=url, strict=strict)


def calls(url: str) -> dict:
    """One request per route naming ``model``: ``{route: call(model)}``."""
    chat = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    local = ollama.Client(host=url, timeout=120)
    return {
        "chat": lambda m: chat.chat.completions.create(model=m, messages=USER, max_tokens=2).choices[0].message,
        "completions": lambda m: chat.completions.create(model=m, prompt="Hi", max_tokens=2).choices[0].text,
        "responses": lambda m: chat.responses.create(model=m, input="Hi", max_output_tokens=2).status,
        "messages": lambda m: messages.messages.create(model=m, messages=USER, max_tokens=2).stop_reason,
        "count_tokens": lambda m: messages.messages.count_tokens(model=m, messages=USER).input_tokens,
        "ollama chat": lambda m: local.chat(model=m, messages=USER, options={"num_predict": 2}).done,
        "ollama generate": lambda m: local.generate(model=m, prompt="Hi", options={"num_predict": 2}).done,
        "ollama show": lambda m: local.show(m).modelinfo,
    }


def test_one_model_serves_any_name_on_every_route(servers):
    for route, call in calls(servers.url).items():
        assert call(FOREIGN), route


def test_strict_names_refuse_a_foreign_name_on_every_route(servers):
    errors = {"chat": openai.NotFoundError, "completions": openai.NotFoundError, "responses": openai.NotFoundError,
              "messages": anthropic.NotFoundError, "count_tokens": anthropic.NotFoundError,
              "ollama chat": ollama.ResponseError, "ollama generate": ollama.ResponseError,
              "ollama show": ollama.ResponseError}
    for route, call in calls(servers.strict).items():
        with pytest.raises(errors[route]) as error:
            call(FOREIGN)
        assert error.value.status_code == 404 and FOREIGN in str(error.value), route
        assert call(MODEL_NAME), route
