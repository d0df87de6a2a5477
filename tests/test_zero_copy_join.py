"""KV in one place (issue 32): a sequence's keys/values are written into its row of the decode
batch from its first prompt chunk on (``cache/rows.py``), so joining the decode steps copies
nothing. Checked with MLX's own memory counters (the join of the old path, measured beside it,
creates a buffer of the batch's size), and by greedy replies of staggered concurrent requests
(each prompt prefilling in its row while the others decode, rows freed and reused, the batch
growing its rows) against ``stream_generate`` alone, for float, 8-bit, rotating, MLA and hybrid
tiny models (rotating rows keep the old join path; hybrid rows: ``test_zero_copy_hybrid.py``), and
with rows crossing ``quantized_kv_start`` (re-encoded into a row of the quantized batch)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from conftest import tiny_byte_llama_of, write_byte_tokenizer, write_tiny_checkpoint
from mlxformer import load, stream_generate
from mlxformer.cache import CacheSettings, make_cache
from mlxformer.cache.batch import BatchLayerCache, batch_key
from mlxformer.cache.rows import RowCache, SpareBatch
from mlxformer.cache.state import StateCache
from mlxformer.cache.state_rows import StateRowCache
from mlxformer.engine import Engine, GenerationRequest
from mlxformer.engine.batch_runner import BatchRunner

LAYERS = 8
CHUNK = 12  # 256 is not a multiple: a chunk crosses a slot block (the batch widens mid-step)


class Stub:
    """What ``BatchRunner`` needs of a sequence."""

    def __init__(self, cache: list, last: int) -> None:
        self.cache, self.speculator, self.last = cache, None, last

    @property
    def last_token(self) -> int:
        return self.last


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_byte_llama_of(tmp_path_factory.mktemp("zero_copy"), LAYERS)


def ids(length: int, seed: int) -> list[int]:
    return [(7 * j + seed) % 250 + 1 for j in range(length)]


@pytest.mark.parametrize("settings", [CacheSettings(), CacheSettings(kv_bits=8, kv_group_size=32)], ids=["float", "kv8"])
def test_a_join_copies_nothing(llama, settings):
    """Two sequences prefill in their rows (given at admission); their first decode step
    creates no array of KV size (MLX's peak memory rises as in a steady step, well under one
    layer of the batch) and leaves their caches the same objects; the old path's join, measured
    the same way, creates the batch's buffer beside the rows' own caches."""
    assert_join_copies_nothing(llama[0], settings)


def assert_join_copies_nothing(model, settings: CacheSettings) -> None:
    """``test_a_join_copies_nothing`` for ``model`` (a hybrid one's recurrent rows too)."""
    layers = len(model.layers)
    windows = [layer.window for layer in model.layers]
    # the old path first (it also pays the process's first decode step): own caches joining a
    # DecodeBatch at their first decode step
    caches = [make_cache(model, settings), make_cache(model, settings)]
    for cache, length in zip(caches, (300, 310)):
        BatchRunner(model).prefill(ids(length, 3), cache, want_logits=False)
    kv = sum(c.nbytes for cache in caches for c in cache if not isinstance(c, StateCache))  # keys/values
    old = [Stub(cache, 5) for cache in caches]
    del caches
    runner = BatchRunner(model)
    old_rise = decode_rises(runner, old, 1)[0][0]
    runner.reset()
    del old

    runner = BatchRunner(model)
    runner.max_rows = 2
    rows = [Stub(make_cache(model, settings), 5), Stub(make_cache(model, settings), 6)]
    for sequence, length in zip(rows, (300, 310)):
        runner.seat(sequence)
        for start in range(0, length, 128):
            runner.prefill(ids(length, 3)[start : start + 128], sequence.cache, want_logits=False)
    assert all(isinstance(c, (RowCache, StateRowCache)) for s in rows for c in s.cache)
    (batch,) = runner.batches.values()
    assert isinstance(batch, SpareBatch) and batch.capacity == 2 and batch_key(make_cache(model, settings), windows) == batch.key
    assert sum(layer.nbytes for layer in batch.layers if isinstance(layer, BatchLayerCache)) == kv  # held once
    stand_ins = [list(s.cache) for s in rows]
    rises, kept = decode_rises(runner, rows, 2)  # the join, then a step of rows already decoding
    # the join step costs what a steady step costs (activations, the quantized step's
    # dequantized scores): no row is copied; the old join's copy shows (the measure can fail)
    assert rises[0] <= rises[1] + kv / (4 * layers), (rises, kv)
    assert old_rise > rises[1] + kv / 5, (old_rise, rises, kv)
    assert kept[0] < kv / (4 * layers)
    assert all(a is b for s, old in zip(rows, stand_ins) for a, b in zip(s.cache, old))
    assert [r.offset for r in batch.layout.rows] == [302, 312]


def decode_rises(runner: BatchRunner, rows: list[Stub], steps: int) -> tuple[list[int], list[int]]:
    """MLX's peak memory over what was held before each of ``steps`` decode steps, and what each left."""
    rises, kept = [], []
    for _ in range(steps):
        mx.eval([layer.state for batch in runner.batches.values() for layer in batch.layers],
                [s.cache[0].state for s in rows])
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        logits = runner.decode(rows)
        mx.eval(logits, [layer.state for batch in runner.batches.values() for layer in batch.layers])
        rises.append(mx.get_peak_memory() - before)
        del logits
        kept.append(mx.get_active_memory() - before)
    return rises, kept


def staggered(model, tokenizer, settings: CacheSettings | None, prompts: list[list[int]], tokens: list[int],
              max_batch: int, **options) -> list[list[int]]:
    """Each prompt submitted once the one before has its first token (``in_turn``) to an engine
    of ``max_batch`` rows (and ``options``); every reply's tokens."""
    engine = Engine(model, tokenizer, max_batch=max_batch, cache_settings=settings, prefill_chunk=CHUNK,
                    step_tokens=2 * CHUNK, prefix_cache_bytes=0, **options)
    return in_turn(engine, [GenerationRequest(p, max_tokens=n) for p, n in zip(prompts, tokens)])


def in_turn(engine: Engine, requests: list[GenerationRequest]) -> list[list[int]]:
    """Each request submitted once the one before has its first token (the earlier ones decode
    while it prefills); every reply's tokens. No step may fail (a failed step is rerun row by
    row, which would hide a fault behind equal replies)."""
    failed = []
    engine._decode_alone = lambda *args: failed.append(args) or []  # type: ignore[method-assign]
    streams = []
    with engine:
        for request in requests:
            stream = iter(engine.submit(request))
            streams.append([next(stream)])
            streams[-1].append(stream)
        replies = [[first.token] + [e.token for e in rest if e.token is not None] for first, rest in streams]
    assert not failed
    return replies


def alone(model, tokenizer, settings: CacheSettings | None, prompt: list[int], tokens: int) -> list[int]:
    return [r.token for r in stream_generate(model, tokenizer, prompt, tokens, cache_settings=settings,
                                             prefill_step_size=CHUNK)]


# the second prompt's rows cross a 256-slot block (the batch widens) while the first decodes
PROMPTS = [ids(30, 1), ids(270, 2), ids(9, 3), ids(40, 4), ids(3, 5)]
TOKENS = [40, 10, 10, 10, 10]


@pytest.mark.parametrize("settings", [None, CacheSettings(kv_bits=8, kv_group_size=32),
                                      CacheSettings(max_kv_size=24, keep=2)], ids=["float", "kv8", "rotating"])
def test_staggered_requests_equal_each_alone(llama, settings):
    """Five prompts, three rows: rows are taken at admission, freed and reused, the batch grows
    its rows and its slots."""
    model, tokenizer = llama
    got = staggered(model, tokenizer, settings, PROMPTS, TOKENS, max_batch=3)
    assert got == [alone(model, tokenizer, settings, p, n) for p, n in zip(PROMPTS, TOKENS)]


MLA = dict(kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=20, num_attention_heads=5,
           num_key_value_heads=5, hidden_size=80, num_hidden_layers=3, q_lora_rank=None, n_routed_experts=8,
           num_experts_per_tok=3, moe_intermediate_size=24, first_k_dense_replace=1, n_shared_experts=2,
           topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.3)
HYBRID = dict(num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=12, linear_value_head_dim=10, linear_conv_kernel_dim=4)


@pytest.mark.parametrize("family", ["deepseek_v2", "qwen3_5_text"], ids=["mla", "hybrid"])
def test_staggered_requests_equal_each_alone_mla_and_hybrid(family, tmp_path):
    directory, _ = write_tiny_checkpoint(tmp_path, family, **(MLA if family == "deepseek_v2" else HYBRID))
    write_byte_tokenizer(directory)
    model, tokenizer = load(directory, dtype=mx.float32)
    tokenizer.eos_token_ids = []
    prompts = [ids(30, 1), ids(21, 2), ids(9, 3), ids(40, 4)]
    got = staggered(model, tokenizer, None, prompts, [8] * 4, max_batch=2)
    assert got == [alone(model, tokenizer, None, p, 8) for p in prompts]


def test_staggered_requests_cross_quantized_kv_start_in_their_rows(llama, monkeypatch):
    """``quantized_kv_start`` = 36: the 30-token prompt's row crosses it while decoding, the 40-
    and 270-token prompts' rows while prefilling (two of the 270's chunks may share a step: they
    then run one after the other). Each crossing re-encodes the row into a row of the quantized
    batch: no row is copied out of a batch (before: it left the float batch with its caches, took
    a step alone and was copied into the quantized batch), and every reply equals its own alone."""
    model, tokenizer = llama
    settings = CacheSettings(kv_bits=8, kv_group_size=32, quantized_kv_start=36)
    copied_out, seated = [], []
    leave, seat = SpareBatch.leave, SpareBatch.seat

    def leaving(self, index, keep=True, staged=False):
        copied_out.append(keep)
        return leave(self, index, keep, staged)

    def seating(self, caches):
        seated.append((self.key[0][0].bits, int(caches[0].offset)))
        return seat(self, caches)

    monkeypatch.setattr(SpareBatch, "leave", leaving)
    monkeypatch.setattr(SpareBatch, "seat", seating)
    got = staggered(model, tokenizer, settings, PROMPTS, TOKENS, max_batch=3)
    assert got == [alone(model, tokenizer, settings, p, n) for p, n in zip(PROMPTS, TOKENS)]
    assert not any(copied_out)
    # five rows seated empty at admission, three re-encoded into the quantized batch where they crossed
    assert len(seated) == 8 and seated.count((None, 0)) == 5 and seated.count((8, 36)) == 3, seated
