"""The chat page in a real headless browser (Debian's chromium driven by Playwright): it loads
from the server, streams the reply to "What is the capital of France?" (greedy SmolLM2 says
Paris), and its stop button ends a long reply and frees the server's slot."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
from server_support import http, load_for_engine, running_engine, running_server

# Debian's package (scripts/install_test_deps.sh installs it); elsewhere point MLXFORMER_CHROMIUM at a Chromium.
CHROMIUM = os.environ.get("MLXFORMER_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]
REPLY_TIMEOUT_MS = 240_000


@pytest.fixture(scope="module")
def server(smollm_gguf):
    model, tokenizer = load_for_engine(smollm_gguf)
    with running_engine(model, tokenizer, max_batch=2) as engine:
        with running_server(engine, model, tokenizer) as url:
            yield url


@pytest.fixture
def page(tmp_path):
    from playwright.sync_api import sync_playwright

    assert shutil.which(CHROMIUM), "chromium is not installed: run scripts/install_test_deps.sh"
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
        )
        try:
            yield context.new_page()
        finally:
            context.close()


def test_chat_page_streams_the_answer(server, page):
    page.goto(server)
    page.wait_for_function("document.getElementById('model').textContent === 'smollm2-test'")
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
