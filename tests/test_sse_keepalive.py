"""SSE keep-alive and prompt progress: while a long prompt is prefilled the stream carries
``: ping`` comments (the official openai client still reads it unchanged) and, with
``return_progress``, llama-server's ``prompt_progress`` objects; a client gone mid-wait cancels."""

from __future__ import annotations

import asyncio
import json


from mlxformer.server.sse import PING, keepalive
from server_support import MODEL_NAME, http, running_engine, running_server


def test_keepalive_pings_while_waiting_and_cleans_up():
    closed = []

    async def slow():
        try:
            yield "data: 1\n\n"
            await asyncio.sleep(0.35)
            yield "data: 2\n\n"
            await asyncio.sleep(10)
            yield "data: never\n\n"
        finally:
            closed.append(True)

    async def run():
        out = []
        async for chunk in keepalive(slow(), 0.1):
            out.append(chunk)
            if chunk == "data: 2\n\n":
                break  # the client goes away while the source waits
        return out

    out = asyncio.run(run())
    assert out[0] == "data: 1\n\n" and out[-1] == "data: 2\n\n"
    assert 2 <= out.count(PING) <= 4 and set(out[1:-1]) == {PING}
    assert closed == [True]


class SlowPrefill:
    """Makes every prompt chunk of an engine take ``seconds`` (a long prompt on a slow machine)."""

    def __init__(self, engine, seconds: float) -> None:
        runner, original = engine.runner, engine.runner.prefill

        def prefill(*args, **kwargs):
            import time
            time.sleep(seconds)
            return original(*args, **kwargs)

        runner.prefill = prefill


def test_long_prefill_streams_pings_and_progress(tiny_byte_llama):
    model, tokenizer = tiny_byte_llama
    prompt = "x" * 60
    with running_engine(model, tokenizer, prefill_chunk=16, step_tokens=16, prefix_cache_bytes=0) as engine:  # a chunk a step
        SlowPrefill(engine, 0.15)
        with running_server(engine, model, tokenizer, sse_ping_seconds=0.1) as url:
            body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 3, "stream": True, "temperature": 0,
                    "return_progress": True}
            status, _, raw = http(url, "POST", "/v1/completions", body)
            plain = {**body, "return_progress": False}
            _, _, without = http(url, "POST", "/v1/completions", plain)
            from openai import OpenAI

            client = OpenAI(base_url=f"{url}/v1", api_key="none")
            streamed = "".join(c.choices[0].text for c in client.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0, stream=True) if c.choices)
    assert status == 200
    events = raw.decode().split("\n\n")
    progress = [json.loads(e[6:])["prompt_progress"] for e in events if e.startswith("data: {") and "prompt_progress" in e]
    assert [p["processed"] for p in progress] == sorted({p["processed"] for p in progress})
    assert progress and all(p["total"] == len(tokenizer.encode(prompt)) and p["cache"] == 0 for p in progress)
    assert ": ping" in without.decode() and "prompt_progress" not in without.decode()
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in without.decode().split("\n\n")
             if e.startswith("data: {") and json.loads(e[6:])["choices"]]
    assert streamed == "".join(texts)  # the official client reads through the comments
