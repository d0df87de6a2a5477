"""The batched decode step: the MLX graph of one step does not grow with the batch (one cache
write and one attention per layer for all rows), and sequences whose caches turn quantized
mid-way (``quantized_kv_start``) still give what they give alone."""

from __future__ import annotations

import re
from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlxformer import stream_generate
from mlxformer.cache import CacheSettings, make_cache
from mlxformer.engine import Engine, GenerationRequest
from mlxformer.engine.batch_runner import BatchRunner

SETTINGS = {
    "float": CacheSettings(),
    "kv8": CacheSettings(kv_bits=8, kv_group_size=32),
    "rotating": CacheSettings(max_kv_size=24, keep=2),
}


def graph_ops(array: mx.array, path) -> int:
    """Operations (primitives) in the unevaluated graph that computes ``array``, from MLX's DOT export."""
    mx.export_to_dot(str(path), array)
    return len(re.findall(r"shape=rectangle", path.read_text()))


def ops_per_step(model, batch: int, settings: CacheSettings, path) -> int:
    """Operations of the second decode step of ``batch`` sequences of different lengths (the
    first one joins them into the batch)."""
    runner = BatchRunner(model)
    sequences = []
    for i in range(batch):
        cache = make_cache(model, settings)
        runner.prefill(list(range(1, 30 + 3 * i)), cache, want_logits=False)
        sequences.append(SimpleNamespace(cache=cache, speculator=None, last_token=5 + i))
    mx.eval(runner.decode(sequences))
    return graph_ops(runner.decode(sequences), path)


@pytest.mark.parametrize("cache", list(SETTINGS))
def test_step_ops_do_not_grow_with_batch(tiny_byte_llama, cache, tmp_path):
    model, _ = tiny_byte_llama
    counts = [ops_per_step(model, b, SETTINGS[cache], tmp_path / f"b{b}.dot") for b in (1, 4, 8)]
    assert counts[0] > 10 * len(model.layers)  # the graph was really walked
    # B = 1 may be a few ops smaller: MLX's CPU rope treats a one-element offsets array as a scalar
    assert counts[0] <= counts[1] == counts[2], counts
    assert counts[1] - counts[0] <= 2 * len(model.layers) * 2, counts


def test_quantized_start_crossed_in_a_batch(tiny_byte_llama):
    """Rows cross ``quantized_kv_start`` at different steps: each moves from the float batch to
    the quantized one, and every output is the one it gets alone."""
    model, tokenizer = tiny_byte_llama
    settings = CacheSettings(kv_bits=4, kv_group_size=32, quantized_kv_start=40)
    prompts = ["abcdefghij" * 3, "hello world, " * 4, "xyz"]
    requests = [GenerationRequest(tokenizer.encode(p), max_tokens=24) for p in prompts]
    expected = [
        [r.token for r in stream_generate(model, tokenizer, q.prompt_ids, q.max_tokens, cache_settings=settings)]
        for q in requests
    ]
    with Engine(model, tokenizer, cache_settings=settings, prefix_cache_bytes=0) as engine:
        handles = [engine.submit(r) for r in requests]
        got = [[e.token for e in h if e.token is not None] for h in handles]
    assert got == expected
