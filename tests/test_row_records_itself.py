"""A forward records its own writes (issue 40): a stream decoding on a pool row's views through
the model's own forwards (no runner, no settle), then in the pool's batched decode steps (which
read the row's recorded positions), gives what its own caches give: the same greedy tokens,
bit-equal logits for float and 8-bit KV, and for a rotating window bit-equal logits until the
window is full (then its wider ring sums in another order)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from conftest import tiny_byte_llama_of
from mlxformer.cache import CacheSettings, make_cache
from mlxformer.engine.batch_runner import BatchRunner

PROMPT = [ord(c) for c in "the sea and the boats "]  # 22 tokens
WINDOW = 40


class Stream:
    """What ``BatchRunner.seat`` asks of a sequence."""

    speculator = None
    adapters = None

    def __init__(self, cache: list) -> None:
        self.cache = cache
        self.last_token = 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_byte_llama_of(tmp_path_factory.mktemp("row_records_itself"), 4)[0]


def decode(model, settings: CacheSettings, tokens: int, pooled: bool) -> tuple[list[int], list[mx.array]]:
    """Greedy ``tokens`` after the prompt, each step's logits; ``pooled``: on a row's views, the
    first half in forwards of the model's own, the rest in the pool's decode steps."""
    stream = Stream(make_cache(model, settings))
    if pooled:
        runner = BatchRunner(model)
        runner.prefill_chunk = len(PROMPT)
        runner.seat(stream)  # its caches are views of its row from now on
    logits = model(mx.array([PROMPT]), stream.cache)[:, -1]
    out, every = [], []
    for step in range(tokens):
        token = mx.argmax(logits, axis=-1)
        stream.last_token = int(token.item())
        if pooled and step >= tokens // 2:
            logits = runner.decode([stream])
        else:
            logits = model(token[:, None], stream.cache)[:, -1]
        mx.eval(logits)
        out.append(stream.last_token)
        every.append(logits)
    return out, every


@pytest.mark.parametrize("settings", [CacheSettings(), CacheSettings(kv_bits=8, kv_group_size=32),
                                      CacheSettings(max_kv_size=WINDOW, keep=2)], ids=["float", "8-bit", "ring"])
def test_a_stream_on_its_row_equals_its_own_caches(tiny, settings):
    tokens = 30
    own, own_logits = decode(tiny, settings, tokens, pooled=False)
    row, row_logits = decode(tiny, settings, tokens, pooled=True)
    assert row == own
    # the ring: bit-equal while the cache holds at most its window (the prompt and the decoded tokens before)
    exact = WINDOW - len(PROMPT) if settings.max_kv_size else tokens
    for step, (a, b) in enumerate(zip(own_logits[:exact], row_logits[:exact])):
        assert mx.array_equal(a, b), step
    for a, b in zip(own_logits[exact:], row_logits[exact:]):
        assert mx.allclose(a, b, atol=1e-4)
