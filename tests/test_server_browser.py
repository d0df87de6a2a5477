"""The chat page in a real headless browser (Debian's chromium driven by Playwright): it loads
from the server, streams the reply to "What is the capital of France?" (greedy SmolLM2 says
Paris), and its stop button ends a long reply and frees the server's slot."""

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
