"""Reasoning: ``<think>`` replies as the families' templates write them (llama.cpp's copies of
Qwen3's, QwQ's and DeepSeek-R1 distills') split into reasoning and answer, streamed one
character at a time = whole; through chat completions on a tiny random model with QwQ's template:
``reasoning_content`` (+ ``reasoning``), streamed = whole, thinking off per request
(``chat_template_kwargs``), and the reasoning budget forcing ``</think>`` at exactly the limit,
after which a json_schema constraint holds for the answer only; the chat page folds it away."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from agent_support import render, rendered_reply, template, tiny_chat_model
from server_support import browser_page, running_engine, running_server

from mlxformer.server.reasoning import CLOSING_TEXT, ThinkSplitter, starts_in_reasoning

USER = [{"role": "user", "content": "What is the capital of France?"}]
THOUGHT, ANSWER = "The user asks about France; its capital is Paris.", "Paris."


def split(text: str, in_reasoning: bool, pieces: list[str] | None = None) -> tuple[str, str]:
    splitter = ThinkSplitter(in_reasoning)
    parts = [splitter.feed(p) for p in (pieces if pieces is not None else [text])] + [splitter.feed("", final=True)]
    return "".join(p.reasoning for p in parts), "".join(p.content for p in parts)


@pytest.mark.parametrize("name", ["Qwen-Qwen3-0.6B", "Qwen-QwQ-32B", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"])
def test_template_replies_split(name):
    source = template(name)
    prompt = render(source, USER, True, enable_thinking=True)
    in_reasoning = starts_in_reasoning(prompt)
    assert in_reasoning == (name != "Qwen-Qwen3-0.6B")  # QwQ's and R1's generation prompts open <think>
    assert not starts_in_reasoning(render(source, USER, True, enable_thinking=False))
    reply = {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}
    text = rendered_reply(source, USER, reply, enable_thinking=True) if name == "Qwen-Qwen3-0.6B" else \
        f"{THOUGHT}\n</think>\n\n{ANSWER}"  # what these models generate after the open <think>
    whole = split(text, in_reasoning)
    assert whole[0].strip() == THOUGHT and whole[1] == ANSWER, text
    assert split(text, in_reasoning, list(text)) == whole


def test_no_reasoning_passes_through():
    assert split("Paris. <think> is a tag", False, list("Paris. <think> is a tag")) == ("", "Paris. <think> is a tag")


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    model, tokenizer = tiny_chat_model(tmp_path_factory.mktemp("qwq"), template("Qwen-QwQ-32B"))
    with running_engine(model, tokenizer, max_batch=2) as engine:
        with running_server(engine, model, tokenizer) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
            yield client, tokenizer, url


def test_budget_closes_reasoning_at_the_limit(thinker):
    client, tokenizer, _ = thinker
    reply = client.chat.completions.create(model="smollm2-test", messages=USER, max_tokens=24, temperature=0,
                                           logprobs=True, extra_body={"reasoning_budget": 5})
    tokens = [t.token for t in reply.choices[0].logprobs.content]
    close = [tokenizer.decode([i]) for i in tokenizer.encode(CLOSING_TEXT, add_special_tokens=False)]
    assert tokens[5:5 + len(close)] == close  # forced right after 5 reasoning tokens
    message = reply.choices[0].message
    assert message.reasoning_content.endswith("\n") and 0 < len(message.reasoning_content) <= 6
    assert message.reasoning == message.reasoning_content and "</think>" not in (message.content or "")
    chunks = list(client.chat.completions.create(model="smollm2-test", messages=USER, max_tokens=24, temperature=0,
                                                 stream=True, extra_body={"reasoning_budget": 5}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == message.content


def test_constraint_applies_to_the_answer_only(thinker):
    client, _, _ = thinker
    schema = {"type": "object", "properties": {"capital": {"enum": ["Paris", "Lyon"]}}, "required": ["capital"]}
    reply = client.chat.completions.create(
        model="smollm2-test", messages=USER, max_tokens=60, temperature=0, extra_body={"reasoning_budget": 4},
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    message = reply.choices[0].message
    assert message.reasoning_content and len(message.reasoning_content.rstrip("\n")) <= 4
    jsonschema.validate(json.loads(message.content), {**schema, "additionalProperties": False})


def test_thinking_off_per_request(thinker):
    client, _, _ = thinker
    reply = client.chat.completions.create(model="smollm2-test", messages=USER, max_tokens=8, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reply.choices[0].message.reasoning_content is None and reply.choices[0].message.content


def test_chat_page_shows_reasoning_collapsed(thinker, tmp_path):
    """The chat page (headless Chromium) puts the reasoning in a closed <details> above the answer."""
    _, _, url = thinker
    with browser_page(tmp_path / "profile") as page:
        page.goto(url)
        page.fill("#temperature", "0")
        page.fill("#max_tokens", "12")
        page.fill("#prompt", "Hi")
        page.click("#send")
        reply = page.locator(".msg.assistant").last
        reply.and_(page.locator("[data-state='done']")).wait_for(timeout=120_000)
        details = reply.locator("details.reasoning")
        assert details.count() == 1 and details.get_attribute("open") is None
        assert details.locator("div").text_content()  # the reasoning is there, folded away
        assert reply.evaluate("b => b.firstElementChild.tagName") == "DETAILS"
