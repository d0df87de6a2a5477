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
from mlxformer.models.row_sharding import WIDE_ROWS

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
    """Operations of the second decode step of ``batch`` sequences of different lengths, each
    prefilled in its row of the pool."""
    runner = BatchRunner(model)
    sequences = []
    for i in range(batch):
        sequence = SimpleNamespace(cache=make_cache(model, settings), speculator=None, last_token=5 + i)
        runner.seat(sequence)
        runner.prefill(list(range(1, 30 + 3 * i)), sequence.cache, want_logits=False)
        sequences.append(sequence)
    mx.eval(runner.decode(sequences))
    return graph_ops(runner.decode(sequences), path)


@pytest.mark.parametrize("cache", list(SETTINGS))
def test_step_ops_do_not_grow_with_batch(tiny_byte_llama, cache, tmp_path):
    model, _ = tiny_byte_llama
    # from WIDE_ROWS rows the CPU's row-sharded projections compute (W @ x^T)^T (a few more ops
    # per projection, not per row), so the batches compared are all past that switch
    batches = (1, WIDE_ROWS, 2 * WIDE_ROWS, 4 * WIDE_ROWS)
    counts = [ops_per_step(model, b, SETTINGS[cache], tmp_path / f"b{b}.dot") for b in batches]
    assert counts[0] > 10 * len(model.layers)  # the graph was really walked
    # B = 1 is smaller: MLX's CPU rope treats a one-element offsets array as a scalar, and the layout
    assert counts[0] <= counts[1] == counts[2] == counts[3], counts


def test_quantized_start_crossed_in_a_batch(tiny_byte_llama):
    """Rows cross ``quantized_kv_start`` at different steps: each moves from the float batch to
    the quantized one, and every output is the one it gets alone."""
    model, tokenizer = tiny_byte_llama
    settings = CacheSettings(kv_bits=4, kv_group_size=32, quantized_kv_start=40)
    assert_engine_matches_alone(model, tokenizer, ["abcdefghij" * 3, "hello world, " * 4, "xyz"], settings, 24)


def assert_engine_matches_alone(model, tokenizer, prompts, settings, max_tokens) -> None:
    """The engine's tokens for concurrent ``prompts`` are those each gets alone."""
    requests = [GenerationRequest(tokenizer.encode(p), max_tokens=max_tokens) for p in prompts]
    expected = [
        [r.token for r in stream_generate(model, tokenizer, q.prompt_ids, q.max_tokens, cache_settings=settings)]
        for q in requests
    ]
    with Engine(model, tokenizer, cache_settings=settings, prefix_cache_bytes=0) as engine:
        handles = [engine.submit(r) for r in requests]
        got = [[e.token for e in h if e.token is not None] for h in handles]
    assert got == expected


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    """A tiny random Gemma 3: sliding-window layers (window 8, rotating caches) between global ones."""
    from conftest import write_byte_tokenizer, write_tiny_checkpoint
    from mlxformer import load

    layer_types = ["sliding_attention", "full_attention"] * 2
    directory, _ = write_tiny_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3_text", head_dim=32,
                                         sliding_window=8, query_pre_attn_scalar=16, num_hidden_layers=4,
                                         layer_types=layer_types)
    write_byte_tokenizer(directory)
    model, tokenizer = load(directory, dtype=mx.float32, threads=1)
    assert [layer.window for layer in model.layers] == [8, None, 8, None]
    tokenizer.eos_token_ids = []  # random weights: every run has all its tokens
    return model, tokenizer


@pytest.mark.parametrize("cache", ["float", "kv8"])
def test_sliding_and_global_layers_batch_too(tiny_gemma3, cache, tmp_path):
    """Gemma 2/3 mix sliding-window and global layers: the batch keeps one slot layout per kind
    of layer, so their step's graph does not grow with the batch either, and each sequence
    (prompts past the window, ragged) still gives what it gives alone."""
    model, tokenizer = tiny_gemma3
    settings = SETTINGS[cache]
    counts = [ops_per_step(model, b, settings, tmp_path / f"b{b}.dot") for b in (1, 4)]
    assert counts[0] <= counts[1] <= counts[0] + 4 * len(model.layers), counts
    assert_engine_matches_alone(model, tokenizer, ["abcdefghij" * 3, "hello world, " * 2, "xyz"], settings, 14)
