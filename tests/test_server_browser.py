"""The chat page in a real headless browser (Debian's chromium driven by Playwright): it loads
from the server, streams the reply to "What is the capital of France?" (greedy SmolLM2 says
Paris), and its stop button ends a long reply and frees the server's slot; left alone, its
sampling fields send nothing, so the model's own defaults apply (SmolLM2 has none: greedy, as an
explicit temperature 0 request); its icon is served."""

from __future__ import annotations

import json
import time

import pytest
from server_support import browser_page, http, load_for_engine, running_engine, running_server

REPLY_TIMEOUT_MS = 240_000


@pytest.fixture(scope="module")
def server(smollm_gguf):
    model, tokenizer = load_for_engine(smollm_gguf)
    with running_engine(model, tokenizer, max_batch=2) as engine:
        with running_server(engine, model, tokenizer) as url:
            yield url


@pytest.fixture
def page(tmp_path):
    with browser_page(tmp_path / "profile") as page:
        yield page


def test_chat_page_streams_the_answer(server, page):
    page.goto(server)
    # a locator, not wait_for_function: Playwright evaluates a string predicate with eval, which the
    # page's Content-Security-Policy refuses once it has to poll
    page.locator("#model", has_text="smollm2-test").wait_for()
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "24")
    page.fill("#prompt", "What is the capital of France?")
    page.click("#send")
    reply = page.locator(".msg.assistant").last
    reply.and_(page.locator("[data-state='done']")).wait_for(timeout=REPLY_TIMEOUT_MS)
    assert "Paris" in reply.text_content()
    assert int(reply.get_attribute("data-chunks")) > 1  # it arrived in pieces
    assert page.locator(".msg.user").last.text_content() == "What is the capital of France?"


def test_stop_button_ends_the_reply_and_frees_the_slot(server, page):
    page.goto(server)
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "4000")
    page.fill("#prompt", "Count from one to one thousand.")
    page.click("#send")
    page.locator(".msg.assistant[data-state='streaming']:not([data-chunks='0'])").wait_for(timeout=REPLY_TIMEOUT_MS)
    page.click("#stop")
    reply = page.locator(".msg.assistant").last
    reply.and_(page.locator("[data-state='stopped']")).wait_for(timeout=10_000)
    deadline = time.monotonic() + 60
    while json.loads(http(server, "GET", "/health")[2])["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert json.loads(http(server, "GET", "/health")[2])["running"] == 0
    assert page.locator("#send").is_enabled()


def test_chat_page_leaves_sampling_to_the_model_and_has_an_icon(server, page):
    answers = []
    page.on("response", lambda response: answers.append((response.url, response.status)))
    page.goto(server)
    page.locator("#model", has_text="smollm2-test").wait_for()
    page.fill("#max_tokens", "12")
    page.fill("#prompt", "What is the capital of France?")
    with page.expect_request("**/v1/chat/completions") as request:
        page.click("#send")
    sent = request.value.post_data_json
    assert "temperature" not in sent and "top_p" not in sent and sent["max_tokens"] == 12
    reply = page.locator(".msg.assistant").last
    reply.and_(page.locator("[data-state='done']")).wait_for(timeout=REPLY_TIMEOUT_MS)
    greedy = http(server, "POST", "/v1/chat/completions", {"messages": sent["messages"], "max_tokens": 12,
                                                            "temperature": 0})
    assert reply.locator(".answer").text_content() == json.loads(greedy[2])["choices"][0]["message"]["content"]
    status, headers, icon = http(server, "GET", "/favicon.ico")
    assert status == 200 and headers["content-type"] == "image/svg+xml" and icon.startswith(b"<svg")
    assert answers and all(status < 400 for _, status in answers), answers
