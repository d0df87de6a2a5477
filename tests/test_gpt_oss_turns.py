"""Issue 44: gpt-oss served with its real chat template (llama.cpp's
``models/templates/openai-gpt-oss-120b.jinja``) reuses the prompt cache turn after turn, although
its sliding layers have dropped most of each prompt.

A tiny random gpt-oss written by transformers' ``GptOssConfig`` (sliding, full, sliding layers; a
48-token window against ~600-token prompts; the CPU's 128-token prefill chunks, wider than the
window) with the Harmony tokenizer of tests/test_harmony.py, served, driven by the official
``openai`` client through an agent's four turns: a question; the assistant's call (with its
reasoning) and the tool's result; the final answer and a new question, where the template drops
the call's reasoning (a final answer follows it), so the rendered history diverges from the
previous prompt where that reasoning began; a last question. Each turn's ``cached_tokens`` is at
least the prefix its prompt shares with the previous one (before: 0 on the second turn, whose
whole first prompt was cached: the window layers' blocks straddling each chunk's window were
dropped), and each reply's tokens are a cold single-stream run's (``stream_generate``, no prompt
cache) on the same prompt ids.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from server_support import MODEL_NAME

WINDOW = 48
REPLY_TOKENS = 12
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Gets the weather.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
TURNS = [  # the messages each turn adds to the conversation
    [{"role": "system", "content": "You are a weather assistant. Answer briefly."},
     {"role": "user", "content": "What is the weather in Paris today?"}],
    [{"role": "assistant", "content": None, "reasoning_content": "I need the weather tool for Paris.",
      "tool_calls": [CALL]},
     {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 20, "sky": "clear"}'}],
    [{"role": "assistant", "content": "Clear and 20 degrees."}, {"role": "user", "content": "And tomorrow?"}],
    [{"role": "assistant", "content": "Probably the same."}, {"role": "user", "content": "Thanks!"}],
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import mlx.core as mx
    from conftest import cpu_default_device, write_tiny_checkpoint
    from server_support import running_engine, running_server
    from test_gpt_oss import GPT_OSS
    from test_harmony import write_harmony_tokenizer

    from mlxformer import load

    directory = tmp_path_factory.mktemp("gpt_oss_turns")
    vocab = write_harmony_tokenizer(directory)
    write_tiny_checkpoint(directory, "gpt_oss", **{**GPT_OSS, "vocab_size": vocab, "sliding_window": WINDOW,
                                                    "max_position_embeddings": 4096})
    write_harmony_tokenizer(directory)  # save_pretrained may have written its own config
    with cpu_default_device():
        model, tokenizer = load(directory, dtype=mx.float32, threads=1)
        with running_engine(model, tokenizer, max_batch=2) as engine:
            handles = []
            submit = engine.submit

            def recording(request):
                handles.append(submit(request))
                return handles[-1]

            engine.submit = recording
            with running_server(engine, model, tokenizer) as url:
                yield SimpleNamespace(url=url, model=model, tokenizer=tokenizer, handles=handles)


def test_each_turn_reuses_the_prefix_it_shares_and_replies_as_cold(served):
    import openai

    from mlxformer.generation.stream import stream_generate

    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    messages: list[dict] = []
    prompts, cached = [], []
    for added in TURNS:
        messages += added
        reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS,
                                               max_tokens=REPLY_TOKENS, temperature=0)
        handle = served.handles[-1]
        prompts.append(handle.sequence.prompt)
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        assert reply.usage.prompt_tokens == len(prompts[-1])
        cold = [r.token for r in stream_generate(served.model, served.tokenizer, prompts[-1], REPLY_TOKENS)]
        assert handle.sequence.generated == cold, len(prompts)
    shared = [0] + [len(os.path.commonprefix([a, b])) for a, b in zip(prompts, prompts[1:])]
    assert len(prompts[0]) > 8 * WINDOW and cached[0] == 0
    # turn 2 extends turn 1's prompt; turn 3's render drops the call's reasoning, so it shares turn 1's
    # prompt (up to where that reasoning began), not turn 2's; turn 4 extends turn 3's
    decode = served.tokenizer.decode
    assert shared[1] == len(prompts[0]) and decode(prompts[1][shared[1]:]).startswith("<|channel|>analysis")
    assert shared[2] == len(prompts[0]) and decode(prompts[2][shared[2]:]).startswith(" to=functions.get_weather")
    assert shared[3] == len(prompts[2])
    assert all(c >= s for c, s in zip(cached, shared)), (cached, shared)


def test_a_hit_inside_a_chunk_ends_where_the_window_was_kept(served):
    """A prompt that leaves a cached one inside a prefill chunk (an edited message): where the
    chunk (128) is wider than the window (48), the window's tokens were kept at the chunk ends
    only, so the hit ends at the last chunk end before the prompts part (256 of 300 shared
    tokens), and the cache rebuilt there goes on as a cold prefill does."""
    import mlx.core as mx
    import numpy as np
    from family_checks import tokens
    from pool_support import held, seated

    from mlxformer.cache import make_cache
    from mlxformer.engine.prefix_cache import PrefixCache
    from mlxformer.generation.steps import prefill

    model, chunk = served.model, 128
    prefix_cache = PrefixCache(2**30, model)
    first = [int(t) for t in tokens(400)]
    caches = make_cache(model)
    for start in range(0, len(first), chunk):  # as the engine publishes a window model's prompt
        prefill(model, mx.array(first[start : start + chunk]), caches, chunk)
        prefix_cache.insert(first[: start + chunk], held(caches))
    second = first[:300] + [int(t) for t in tokens(60, seed=2)]
    hit, n = prefix_cache.lookup(second)
    assert n == 256
    cold = prefill(model, mx.array(second), make_cache(model), chunk)
    warm = prefill(model, mx.array(second[n:]), seated(model, hit, chunk), chunk)
    assert np.abs(np.array(warm) - np.array(cold)).max() < 1e-4
