"""KV in one place (issue 32): a sequence's keys/values are written into its row of the decode
batch from its first prompt chunk on (``cache/pool.py``), so joining the decode steps copies
nothing. Checked with MLX's own memory counters (the join of the old path, measured beside it,
creates a buffer of the batch's size), and by greedy replies of staggered concurrent requests
(each prompt prefilling in its row while the others decode, rows freed and reused, the batch
growing its rows) against ``stream_generate`` alone, for float, 8-bit, rotating (a
``max_kv_size`` window, Mistral's sliding window, Gemma 3's sliding and global layers, Gemma 4's
KV-shared layers), MLA (also with a ``max_kv_size`` window: its many-query path attends over
the ring row's pieces) and hybrid tiny models (hybrid rows: ``test_zero_copy_hybrid.py``), and
with rows crossing ``quantized_kv_start`` (re-encoded into a row of the quantized batch)."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest

from conftest import tiny_byte_llama_of, write_byte_tokenizer, write_tiny_checkpoint
from mlxformer import load, stream_generate
from mlxformer.cache import CacheSettings, make_cache
from mlxformer.cache.batch import BatchLayerCache
from mlxformer.cache.batch_kind import pool_key
from mlxformer.cache.rotating_rows import ring_key
from mlxformer.cache.pool import RowCache, KVPool
from mlxformer.cache.state import StateCache
from mlxformer.cache.state_rows import StateRowCache, StateRows
from mlxformer.engine import Engine, GenerationRequest
from mlxformer.engine.batch_runner import BatchRunner, TokenRun

LAYERS = 8
CHUNK = 12  # 256 is not a multiple: a chunk crosses a slot block (the batch widens mid-step)


class Stub:
    """What ``BatchRunner`` needs of a sequence."""

    def __init__(self, cache: list, last: int) -> None:
        self.cache, self.speculator, self.last = cache, None, last

    @property
    def last_token(self) -> int:
        return self.last


def plain_and_speculating(model) -> tuple[BatchRunner, Stub, Stub]:
    """A runner of two rows, and two stub sequences of ``model`` on own caches, the second
    speculating."""
    runner = BatchRunner(model)
    runner.max_rows = 2
    plain, speculating = Stub(make_cache(model), 5), Stub(make_cache(model), 6)
    speculating.speculator = object()
    return runner, plain, speculating


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_byte_llama_of(tmp_path_factory.mktemp("zero_copy"), LAYERS)


def ids(length: int, seed: int) -> list[int]:
    return [(7 * j + seed) % 250 + 1 for j in range(length)]


@pytest.mark.parametrize("settings", [CacheSettings(), CacheSettings(kv_bits=8, kv_group_size=32)], ids=["float", "kv8"])
def test_a_join_copies_nothing(llama, settings):
    """Two sequences prefill in their rows (given at admission); their first decode step
    creates no array of KV size (MLX's peak memory rises as in a steady step, well under one
    layer of the batch) and leaves their caches the same objects; the pool holds what their own
    caches would (before the pool, a join copied own caches into the batch: the whole KV twice)."""
    model, _ = llama
    kv, batch = assert_join_copies_nothing(model, settings)
    assert sum(layer.nbytes for layer in batch.layers) == kv  # the same buffers, held once
    assert [r.offset for r in next(iter(batch.layouts.values())).rows] == [302, 312]


def assert_join_copies_nothing(model, settings: CacheSettings, chunk: int = 128,
                               staged: bool = False) -> tuple[int, KVPool]:
    """``test_a_join_copies_nothing`` for ``model`` and ``settings`` (prompts of 300 and 310
    tokens in chunks of ``chunk``); the own caches' KV bytes and the seated batch. ``staged``:
    as under a KV budget (a row added per seat, the rows widened before each chunk as
    ``Admission.grow`` does, every rewrite one layer at a time)."""
    windows = [layer.window for layer in model.cache_layers]
    # what the same prompts' own caches store (keys/values), to compare the pool's buffers with
    caches = [make_cache(model, settings), make_cache(model, settings)]
    for cache, length in zip(caches, (300, 310)):
        for start in range(0, length, chunk):
            BatchRunner(model).prefill(ids(length, 3)[start : start + chunk], cache, want_logits=False)
    kv = sum(c.nbytes for cache in caches for c in cache if not isinstance(c, StateCache))  # keys/values
    del caches
    warm_up_decoding(model, settings)

    runner = BatchRunner(model)
    runner.max_rows, runner.prefill_chunk, runner.staged = 2, chunk, staged
    rows = [Stub(make_cache(model, settings), 5), Stub(make_cache(model, settings), 6)]
    for sequence, length in zip(rows, (300, 310)):
        runner.seat(sequence)
        for start in range(0, length, chunk):
            tokens = ids(length, 3)[start : start + chunk]
            if staged:
                runner.reserve(sequence, len(tokens))
            runner.prefill(tokens, sequence.cache, want_logits=False)
    assert all(isinstance(c, (RowCache, StateRowCache)) for s in rows for c in s.cache)
    (batch,) = runner.pools.values()
    assert isinstance(batch, KVPool) and batch.capacity == 2
    assert ring_key(pool_key([c.held() for c in make_cache(model, settings)], windows), chunk) == batch.key
    attention = [layer for layer in batch.layers if isinstance(layer, BatchLayerCache)]
    held = sum(layer.nbytes for layer in attention)
    layer = held / len(attention)  # one layer of the batch (Gemma 4's: 3 cache layers for 5)
    stand_ins = [list(s.cache) for s in rows]
    rises, kept = decode_rises(runner, rows, 2)  # the join, then a step of rows already decoding
    # the join step costs what a steady step costs (activations, the quantized step's
    # dequantized scores): no row is copied
    assert rises[0] <= rises[1] + layer / 4, (rises, held)
    assert kept[0] < layer / 4
    assert all(a is b for s, old in zip(rows, stand_ins) for a, b in zip(s.cache, old))
    return kv, batch


@pytest.mark.parametrize("family", ["rotating", "mistral", "gemma3", "gemma4", "mla"])
def test_a_rotating_join_copies_nothing(family, llama, tmp_path):
    """The same for rotating rows (chunks of 128 past windows of 16 to 96: written in pieces
    of at most the window, the ring turning inside a chunk), models mixing sliding and global
    layers (one slot layout per kind of layer, a row in each), Gemma 4's KV-shared layers, and
    an MLA model's ``max_kv_size`` window (its chunks attend in the expanded form, piece by
    piece over the row; before, its rows were prefilled apart and copied in at the join)."""
    model, settings = rotating_model(family, llama, tmp_path)
    _, batch = assert_join_copies_nothing(model, settings)
    for kind, layout in batch.layouts.items():
        assert [r.offset for r in layout.rows] == [302, 312]
        if kind[0].rotating:  # every row's slots full: its ring turns
            assert all(r.used == kind[0].capacity for r in layout.rows), (kind, layout.rows)


@pytest.mark.parametrize("settings", [CacheSettings(), CacheSettings(max_kv_size=512, keep=2)], ids=["float", "ring"])
def test_a_chunk_riding_beside_decoding_rows_writes_in_place(llama, settings):
    """A prompt chunk in its seated row, riding in the step of a row decoding in the same batch:
    every segment writes before any attends (``cache/packed.py``), so MLX writes each layer's
    buffer in place. MLX's peak over what was held stays within the chunk's own activations
    (measured: 0.33 of a layer of the batch); before, the decoding row's attention kept the
    buffer the chunk's write replaced, and each layer was copied (1.29 layers at the peak, the
    whole batch's KV moved every step a chunk rode). ``ring``: the decoding row's ring has
    turned; the chunk's ring row writes where it attends, before the decoding rows fetch
    (measured: 0.46 layers; before, 1.42)."""
    alone, riding = riding_rises(llama[0], settings)
    assert riding < alone + 0.5, (alone, riding)


@pytest.mark.parametrize("settings", [CacheSettings(), CacheSettings(max_kv_size=512, keep=2)], ids=["float", "ring"])
def test_an_mla_chunk_riding_beside_decoding_rows_writes_in_place(mla, settings):
    """The same for MLA's latents in a packed step (``MLAttention._packed``: every segment's
    latents written, by ``PackedLayerCache.each``, before any fetching attention). Measured over
    the step alone: 0.37 (float) and 0.51 (ring) of a layer, the chunk's expanded form's
    activations; with each segment attending before the next writes, 1.35 and 1.54 (each layer
    copied). Before MLA packed, ``BatchRunner._one_by_one`` ordered the forwards by a host sync."""
    alone, riding = riding_rises(mla[0], settings)
    assert riding < alone + 0.9, (alone, riding)


def riding_rises(model, settings: CacheSettings) -> tuple[float, float]:
    """MLX's peak over what was held, in attention layers of the batch (a hybrid's recurrent
    layers hold little), at a decode step of a row of 600 tokens alone, and with a prompt
    chunk of 16 tokens riding in the step in its seated row of the same batch."""
    runner = BatchRunner(model)
    runner.max_rows, runner.prefill_chunk = 2, 16
    decoding, prefilling = Stub(make_cache(model, settings), 5), Stub(make_cache(model, settings), 6)
    runner.seat(decoding)
    runner.seat(prefilling)
    for start in range(0, 600, 128):
        runner.prefill(ids(600, 3)[start : start + 128], decoding.cache, want_logits=False)
    runner.prefill(ids(16, 4), prefilling.cache, want_logits=False)
    (batch,) = runner.pools.values()
    if settings.max_kv_size:  # the decoding row's ring has turned
        (layout,) = batch.layouts.values()
        assert layout.rows[0].used == layout.kind.capacity < 600
    attention = [x.nbytes for x in batch.layers if not isinstance(x, StateRows)]
    layer = sum(attention) / len(attention)

    def rise(riding: bool) -> float:
        mx.eval([x.state for x in batch.layers])
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        chunks = [TokenRun(ids(16, 9), prefilling.cache, False, 600)] if riding else []
        logits, _ = runner.step([decoding], chunks)
        mx.eval(logits, [x.state for x in batch.layers])
        return (mx.get_peak_memory() - before) / layer

    rise(False)  # the process's first steps pay for more than a step
    return rise(False), rise(True)


def warm_up_decoding(model, settings: CacheSettings | None) -> None:
    """One decode step of a short seated row (the process's first steps pay for more than a step)."""
    runner = BatchRunner(model)
    warm = Stub(make_cache(model, settings), 5)
    runner.seat(warm)
    runner.prefill(ids(8, 1), warm.cache, want_logits=False)
    decode_rises(runner, [warm], 1)
    runner.reset()


def decode_rises(runner: BatchRunner, rows: list[Stub], steps: int) -> tuple[list[int], list[int]]:
    """MLX's peak memory over what was held before each of ``steps`` decode steps, and what each left
    (earlier tests' garbage collected first: an engine's reference cycles hold its caches, and
    their arrays freed by a collection during a step would hide what the step allocates)."""
    rises, kept = [], []
    for _ in range(steps):
        gc.collect()
        mx.eval([layer.state for batch in runner.pools.values() for layer in batch.layers],
                [s.cache[0].state for s in rows])
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        logits = runner.decode(rows)
        mx.eval(logits, [layer.state for batch in runner.pools.values() for layer in batch.layers])
        rises.append(mx.get_peak_memory() - before)
        del logits
        kept.append(mx.get_active_memory() - before)
    return rises, kept


def staggered(model, tokenizer, settings: CacheSettings | None, prompts: list[list[int]], tokens: list[int],
              max_batch: int, seats: bool = True, chunk: int = CHUNK, **options) -> list[list[int]]:
    """Each prompt submitted once the one before has its first token (``in_turn``) to an engine
    of ``max_batch`` rows (and ``options``; prompt chunks of ``chunk``); every reply's tokens.
    ``seats``: whether every sequence takes its batch row at admission (else each joins at its
    first decode step)."""
    engine = Engine(model, tokenizer, max_batch=max_batch, cache_settings=settings, prefill_chunk=chunk,
                    step_tokens=2 * chunk, prefix_cache_bytes=0, **options)
    return in_turn(engine, [GenerationRequest(p, max_tokens=n) for p, n in zip(prompts, tokens)], seats)


def in_turn(engine: Engine, requests: list[GenerationRequest], seats: bool | None = None) -> list[list[int]]:
    """Each request submitted once the one before has its first token (the earlier ones decode
    while it prefills); every reply's tokens. No step may fail (a failed step is rerun row by
    row, which would hide a fault behind equal replies). ``seats``: whether every sequence must
    (or must not) have taken its batch row at admission."""
    failed, seated = [], []
    engine.decoding.run_alone = lambda *args: failed.append(args) or []  # type: ignore[method-assign]
    seat = engine.runner.seat

    def recorded_seat(sequence, held=None) -> None:
        seat(sequence, held)
        seated.append(all(isinstance(c, (RowCache, StateRowCache)) for c in sequence.cache))

    engine.runner.seat = recorded_seat  # type: ignore[method-assign]
    streams = []
    with engine:
        for request in requests:
            stream = iter(engine.submit(request))
            streams.append([next(stream)])
            streams[-1].append(stream)
        replies = [[first.token] + [e.token for e in rest if e.token is not None] for first, rest in streams]
    assert not failed
    if seats is not None:
        assert seated == [seats] * len(requests)
    return replies


def watch_rounds(runner: BatchRunner, kinds: tuple[type, ...]) -> list[bool]:
    """Whether each speculation round ``runner`` runs (in a step's forward, or in one of its
    own) is on caches of ``kinds`` (a row's), in order."""
    rounds: list[bool] = []
    step, verify = runner.step, runner.verify

    def watched_step(sequences, chunks=(), inputs=None):
        rounds.extend(all(isinstance(c, kinds) for c in chunk.cache) for chunk in chunks if chunk.every)
        return step(sequences, chunks, inputs)

    def watched_verify(last, proposed, cache):
        rounds.append(all(isinstance(c, kinds) for c in cache))
        return verify(last, proposed, cache)

    runner.step, runner.verify = watched_step, watched_verify  # type: ignore[method-assign]
    return rounds


def alone(model, tokenizer, settings: CacheSettings | None, prompt: list[int], tokens: int,
          chunk: int = CHUNK) -> list[int]:
    return [r.token for r in stream_generate(model, tokenizer, prompt, tokens, cache_settings=settings,
                                             prefill_step_size=chunk)]


# the second prompt's rows cross a 256-slot block (the batch widens) while the first decodes
PROMPTS = [ids(30, 1), ids(270, 2), ids(9, 3), ids(40, 4), ids(3, 5)]
TOKENS = [40, 10, 10, 10, 10]


@pytest.mark.parametrize("settings", [None, CacheSettings(kv_bits=8, kv_group_size=32),
                                      CacheSettings(max_kv_size=24, keep=2),
                                      CacheSettings(max_kv_size=24, keep=2, kv_bits=8, kv_group_size=32)],
                         ids=["float", "kv8", "rotating", "rotating_kv8"])
def test_staggered_requests_equal_each_alone(llama, settings):
    """Five prompts, three rows: rows are taken at admission, freed and reused, the batch grows
    its rows and its slots (a rotating row: its ring turns, two chunks of a prompt in a step)."""
    model, tokenizer = llama
    got = staggered(model, tokenizer, settings, PROMPTS, TOKENS, max_batch=3)
    assert got == [alone(model, tokenizer, settings, p, n) for p, n in zip(PROMPTS, TOKENS)]


MLA = dict(kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=20, num_attention_heads=5,
           num_key_value_heads=5, hidden_size=80, num_hidden_layers=3, q_lora_rank=None, n_routed_experts=8,
           num_experts_per_tok=3, moe_intermediate_size=24, first_k_dense_replace=1, n_shared_experts=2,
           topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.3)
HYBRID = dict(num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=12, linear_value_head_dim=10, linear_conv_kernel_dim=4)


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("mla"), "deepseek_v2", **MLA)


# (cache settings, prompt chunk, budgeted): a window of 24 past prompts of up to 40 tokens,
# chunks of 12 (the absorbed form); a window of 16, chunks of 20 (the expanded form, a chunk in
# pieces of 16 and 4); the window of 24 under a KV budget of two rows; 8-bit latents, growing
# and in the window of 24
MLA_RINGS = {"growing": (None, CHUNK, False), "ring": (CacheSettings(max_kv_size=24, keep=2), CHUNK, False),
             "ring_expanded": (CacheSettings(max_kv_size=16, keep=2), 20, False),
             "ring_budget": (CacheSettings(max_kv_size=24, keep=2), CHUNK, True),
             "kv8": (CacheSettings(kv_bits=8, kv_group_size=32), 20, False),
             "ring_kv8": (CacheSettings(max_kv_size=24, keep=2, kv_bits=8, kv_group_size=32), CHUNK, False)}


@pytest.mark.parametrize("case", list(MLA_RINGS))
def test_staggered_requests_equal_each_alone_mla(mla, case, monkeypatch):
    """MLA latents in rows (hybrid rows: ``test_zero_copy_hybrid.py``), also a ``max_kv_size``
    window's ring rows, seated at admission (before: prefilled apart and copied in at the join),
    with and without a KV budget, float or 8-bit: every sequence seated, each step's rows and
    chunks in one forward (``cache/packed.py``), greedy replies equal each alone."""
    model, tokenizer = mla
    settings, chunk, budgeted = MLA_RINGS[case]
    prompts = [ids(30, 1), ids(21, 2), ids(9, 3), ids(40, 4)]
    budget = Engine(model, tokenizer, cache_settings=settings, prefill_chunk=chunk).sizer.peak(48)
    forwards = record_forwards(monkeypatch)
    got = staggered(model, tokenizer, settings, prompts, [8] * 4, max_batch=2, chunk=chunk,
                    max_kv_memory=2 * budget if budgeted else None)
    assert got == [alone(model, tokenizer, settings, p, 8, chunk) for p in prompts]
    # a step of rows and chunks is one forward (before: one per batch and per chunk)
    assert "packed" in forwards and "one by one" not in forwards, forwards


def record_forwards(monkeypatch) -> list[str]:
    """How each engine step of several parts (batches, chunks) runs: "packed" in one forward, or
    "one by one"."""
    seen: list[str] = []
    packed, one_by_one = BatchRunner._packed, BatchRunner._one_by_one

    def packing(self, groups, tokens, chunks):
        seen.append("packed")
        return packed(self, groups, tokens, chunks)

    def apart(self, groups, tokens, chunks):
        if len(groups) + len(chunks) > 1:
            seen.append("one by one")
        return one_by_one(self, groups, tokens, chunks)

    monkeypatch.setattr(BatchRunner, "_packed", packing)
    monkeypatch.setattr(BatchRunner, "_one_by_one", apart)
    return seen


@pytest.mark.parametrize("family, window", [("mistral", 20), ("gemma3", 8), ("gemma4", 7)])
def test_staggered_requests_equal_each_alone_sliding(family, window, tmp_path):
    """Sliding-window layers (Mistral's, every layer; Gemma 3's between global layers; Gemma 4's
    too, its last layers reading earlier layers' keys/values) in rows: windows smaller than the
    prompts, chunks of 12 crossing them (a window of 8 or 7 takes a chunk in two pieces)."""
    model, tokenizer = sliding_model(tmp_path, family, window, layers=4)
    got = staggered(model, tokenizer, None, PROMPTS, TOKENS, max_batch=3)
    assert got == [alone(model, tokenizer, None, p, n) for p, n in zip(PROMPTS, TOKENS)]


# a rotation that depends on each sequence's length: past the trained 32 positions, Dynamic NTK's
# base grows with the length, LongRoPE's long factors take over (Phi-4-mini's kind)
UNPACKED = {
    "dynamic": ("llama", dict(max_position_embeddings=32,
                              rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})),
    "longrope": ("phi3", dict(max_position_embeddings=512, original_max_position_embeddings=32, pad_token_id=0,
                              bos_token_id=1, eos_token_id=2, rope_parameters=dict(
        rope_type="longrope", rope_theta=1e4, short_factor=[1.0 + 0.1 * i for i in range(8)],
        long_factor=[1.0 + 0.7 * i for i in range(8)]))),
}


@pytest.mark.parametrize("name", list(UNPACKED))
def test_staggered_requests_equal_each_alone_unpacked(name, tmp_path, monkeypatch):
    """A model whose RoPE depends on each sequence's length does not pack: a step of several
    parts (a batch's rows, prompt chunks riding beside them) runs forward by forward, a row's
    built once the forward reading its batch's buffers is evaluated (``BatchRunner._one_by_one``).
    Prompts of 3 to 270 tokens in seated rows, staggered: every reply equals its own alone."""
    family, config = UNPACKED[name]
    model, tokenizer = tiny_model(tmp_path, family, **config)
    assert not BatchRunner(model).packs
    forwards = record_forwards(monkeypatch)
    got = staggered(model, tokenizer, None, PROMPTS, TOKENS, max_batch=3)
    assert got == [alone(model, tokenizer, None, p, n) for p, n in zip(PROMPTS, TOKENS)]
    assert "one by one" in forwards and "packed" not in forwards, forwards


def tiny_model(directory, family: str, **config):
    """A tiny random ``family`` model with the byte tokenizer, float32, no end of sequence."""
    write_tiny_checkpoint(directory, family, **config)
    write_byte_tokenizer(directory)
    model, tokenizer = load(directory, dtype=mx.float32)
    tokenizer.eos_token_ids = []
    return model, tokenizer


def test_staggered_requests_cross_quantized_kv_start_in_their_rows(llama, monkeypatch):
    """``quantized_kv_start`` = 36: the 30-token prompt's row crosses it while decoding, the 40-
    and 270-token prompts' rows while prefilling (two of the 270's chunks may share a step: they
    then run one after the other). Each crossing re-encodes the row into a row of the quantized
    pool (the float row freed, nothing copied out), and every reply equals its own alone."""
    model, tokenizer = llama
    settings = CacheSettings(kv_bits=8, kv_group_size=32, quantized_kv_start=36)
    seated: list[tuple[int | None, int]] = []
    seat = KVPool.seat

    def seating(self, caches):
        seated.append((self.key[0][0].bits, int(caches[0].offset)))
        return seat(self, caches)

    monkeypatch.setattr(KVPool, "seat", seating)
    got = staggered(model, tokenizer, settings, PROMPTS, TOKENS, max_batch=3)
    assert got == [alone(model, tokenizer, settings, p, n) for p, n in zip(PROMPTS, TOKENS)]
    # five rows seated empty at admission, three re-encoded into the quantized batch where they crossed
    assert len(seated) == 8 and seated.count((None, 0)) == 5 and seated.count((8, 36)) == 3, seated


_S, _F = "sliding_attention", "full_attention"
# Gemma 4 E2B-like (``tests/test_gemma4.py``): per-layer inputs, the last two layers reading the
# keys/values of the last earlier layer of their kind, which has a head size of its own
GEMMA4 = dict(hidden_size=40, num_attention_heads=3, num_key_value_heads=1, head_dim=16, global_head_dim=24,
              intermediate_size=36, final_logit_softcapping=30.0, num_hidden_layers=5, layer_types=[_S, _F, _S, _S, _F],
              hidden_size_per_layer_input=6, vocab_size_per_layer_input=256, num_kv_shared_layers=2,
              use_double_wide_mlp=True)


def sliding_model(directory, family: str, window: int, layers: int):
    """Mistral (every layer slides), Gemma 3 (sliding and global layers in turn) with ``window``,
    or the Gemma 4 above (``layers`` aside)."""
    if family == "gemma4":
        model, tokenizer = tiny_model(directory, "gemma4_text", sliding_window=window, **GEMMA4)
        assert model.args.num_kv_shared_layers == 2
        assert [layer.window for layer in model.layers] == [window, None, window, window, None]
        return model, tokenizer
    if family == "mistral":
        model, tokenizer = tiny_model(directory, "mistral", head_dim=32, sliding_window=window, num_hidden_layers=layers)
    else:
        model, tokenizer = tiny_model(directory, "gemma3_text", head_dim=32, sliding_window=window,
                                      query_pre_attn_scalar=16, num_hidden_layers=layers,
                                      layer_types=[_S, _F] * (layers // 2))
    expected = [window] * layers if family == "mistral" else [window, None] * (layers // 2)
    assert [layer.window for layer in model.layers] == expected
    return model, tokenizer


def rotating_model(family: str, llama, directory) -> tuple:
    """``test_a_rotating_join_copies_nothing``'s model and cache settings."""
    if family == "rotating":
        return llama[0], CacheSettings(max_kv_size=96, keep=2)
    if family == "mla":
        return tiny_model(directory, "deepseek_v2", **MLA)[0], CacheSettings(max_kv_size=96, keep=2)
    return sliding_model(directory, family, {"mistral": 48, "gemma3": 24, "gemma4": 16}[family], LAYERS)[0], CacheSettings()
