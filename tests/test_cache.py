"""KV cache family: quantized, rotating, deferred quantization, prompt cache files and cache-prompt.

Tiny random models cover breadth; the real SmolLM2 is used where quality is the claim.
References: ``mx.dequantize`` + ``mx.fast.scaled_dot_product_attention``, the plain float
``KVCache``, the uncached forward pass of a sliding-window model, and uninterrupted runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from mlxformer.cache import CacheSettings, make_cache  # noqa: E402
from mlxformer.cache.codec import CENTER_BLOCK, KVCodec, is_power_of_two, rotate, unrotate  # noqa: E402
from mlxformer.cache.kv import KVCache  # noqa: E402
from mlxformer.cache.rotating import RotatingKVCache  # noqa: E402
from mlxformer.cli import main  # noqa: E402
from mlxformer.models.config import ModelArgs  # noqa: E402
from mlxformer.errors import MlxformerError  # noqa: E402
from mlxformer.generation.stream import stream_generate  # noqa: E402
from mlxformer.models.decoder import Model  # noqa: E402
from mlxformer.generation.prompt_cache_files import (  # noqa: E402
    cache_prompt, load_prompt_cache, save_prompt_cache, strip_cached_prefix,
)
from mlxformer.tools.perplexity import cached_perplexity  # noqa: E402
from mlxformer.text.tokenizer import HFBackend, Tokenizer  # noqa: E402

EVAL_TEXT = Path(__file__).parent / "data" / "eval.txt"

TINY = dict(
    model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=256,
    max_position_embeddings=8192, rope_theta=10000.0,
)


def tiny_model(seed: int = 0, **overrides: object) -> Model:
    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict({**TINY, **overrides}))
    mx.eval(model.parameters())
    return model


def tiny_tokenizer(renamed: int | None = None) -> Tokenizer:
    """A 256-token word-level tokenizer; ``renamed`` gives that id another token string."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    vocab = {(f"other{i}" if i == renamed else f"t{i}"): i for i in range(256)}
    return Tokenizer(HFBackend(HFTokenizer(models.WordLevel(vocab, unk_token="t0"))), None, [], None)


TOKENIZER = tiny_tokenizer()


def tokens(n: int, seed: int = 1, vocab: int = 256) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def run_chunks(model: Model, ids: list[int], cache: list, chunks: list[int]) -> list[mx.array]:
    """Feed ``ids`` through ``cache`` in chunks of the given sizes; the logits (L, V) of each chunk."""
    out, start = [], 0
    for size in chunks:
        logits = model(mx.array(ids[start : start + size])[None], cache)[0]
        mx.eval(logits)
        out.append(logits)
        start += size
    return out


def max_rel_error(a: mx.array, b: mx.array) -> float:
    return float(mx.max(mx.abs(a - b))) / float(mx.max(mx.abs(b)))


# --- quantized attention and cache on tiny models ------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("mask_kind", [None, "causal", "array"])
def test_quantized_attention_matches_dequantized_sdpa(bits: int, mask_kind: str | None) -> None:
    """GQA (8 query heads over 2 kv heads) on packed (centered, rotated) K/V equals fused SDPA
    on the dequantized K/V, and the packs decode back to the original keys/values."""
    mx.random.seed(3)
    B, n_heads, n_kv, L, S, D = 2, 8, 2, 5, 37, 64
    q = mx.random.normal((B, n_heads, L, D))
    k = mx.random.normal((B, n_kv, S, D))
    v = mx.random.normal((B, n_kv, S, D))
    k = k + mx.random.normal((1, n_kv, 1, D)) * 3  # a per-channel offset, as real keys have
    k = k + mx.concatenate([mx.zeros((1, n_kv, 18, D)), mx.ones((1, n_kv, 19, D))], axis=2)  # drifts at 128
    positions = list(range(110, 110 + S))  # 18 keys in center block 0, 19 in block 1: a center each
    codec = KVCodec(bits, 64).with_key_center(k, positions)
    blocks = [p // CENTER_BLOCK for p in positions]
    assert codec.key_center is not None and codec.key_center.shape == (B, n_kv, 2, D)
    assert mx.allclose(codec.key_center[:, :, 1:] - codec.key_center[:, :, :1],
                       k[:, :, 18:].mean(axis=2, keepdims=True) - k[:, :, :18].mean(axis=2, keepdims=True), atol=1e-4)
    kq, vq = codec.encode_keys(k, blocks), codec.encode(v)
    centers = mx.take(codec.key_center, mx.array(blocks), axis=2)  # (B, n_kv, S, D): each key's center
    k_ref, v_ref = codec.decode(kq) + centers, codec.decode(vq)  # keys come back centered
    tolerance = {8: 0.03, 4: 0.5}[bits]
    assert float(mx.abs(k_ref - k).max()) < tolerance
    assert float(mx.abs(v_ref - v).max()) < tolerance
    mask = mx.random.uniform(shape=(L, S)) > 0.3 if mask_kind == "array" else mask_kind
    if mask_kind == "array":
        mask[:, 0] = True  # every query sees at least one key
    got = codec.attention(q, kq, vq, 0.125, mask, key_blocks=mx.array(blocks))
    ref = mx.fast.scaled_dot_product_attention(q, k_ref, v_ref, scale=0.125, mask=mask)
    assert got.shape == (B, n_heads, L, D)
    assert mx.allclose(got, ref, atol=2e-4, rtol=2e-4)


def test_4bit_keys_with_turning_offsets_stay_accurate_along_the_context() -> None:
    """Keys whose per-channel offset turns with the position, as RoPE turns real keys' offsets
    (SmolLM2's base 1e5), fed in 64-token chunks to a 4-bit cache: attention over 8,192 of them
    is as close to float attention as over 256 (mean relative error 0.22 at 8,192; before, with
    one center fixed from the first chunk, 0.30-0.35 against 0.22 at 256)."""

    def error(n: int, seed: int) -> float:
        mx.random.seed(seed)
        pre = 4.0 * mx.random.normal((1, 1, 1, 64)) + mx.random.normal((1, 1, n, 64))  # (1, 1, n, 64)
        keys = mx.fast.rope(pre, 64, traditional=False, base=100000.0, scale=1.0, offset=0)
        values, queries = mx.random.normal((1, 1, n, 64)), mx.random.normal((1, 1, 64, 64))
        cache = KVCache(4, 64)
        for start in range(0, n, 64):
            k, v = cache.update_and_fetch(keys[:, :, start : start + 64], values[:, :, start : start + 64])
        got = cache.attention(queries, k, v, 0.125, None)
        ref = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask=None)
        return float(mx.mean(mx.abs(got - ref)) / mx.mean(mx.abs(ref)))

    short, long = (np.mean([error(n, seed) for seed in range(3)]) for n in (256, 8192))
    assert short < 0.25 and long < 0.26, (short, long)


def sylvester_hadamard(dim: int) -> np.ndarray:
    """The normalized ``(dim, dim)`` Hadamard matrix built densely (the codec's former rotation)."""
    h = np.ones((1, 1))
    while h.shape[0] < dim:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    return h / np.sqrt(dim)


@pytest.mark.parametrize("dim", [64, 128, 96])
def test_rotation_equals_the_dense_orthogonal_rotation(dim: int) -> None:
    """``rotate``/``unrotate`` equal the dense ``x @ R`` / ``x @ R^T``: R the normalized Hadamard
    matrix for powers of two, a fixed orthogonal matrix otherwise (96: the fallback)."""
    mx.random.seed(0)
    x = mx.random.normal((2, 3, 5, dim))
    rotated = np.array(rotate(x, 0.125))
    if is_power_of_two(dim):
        dense = sylvester_hadamard(dim)
        np.testing.assert_allclose(rotated, 0.125 * np.array(x) @ dense, atol=1e-5)
    else:  # orthogonal: norms are kept
        np.testing.assert_allclose(np.linalg.norm(rotated, axis=-1), 0.125 * np.linalg.norm(np.array(x), axis=-1), rtol=1e-5)
    np.testing.assert_allclose(np.array(unrotate(rotate(x))), np.array(x), atol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
def test_codec_equals_the_dense_rotation_codec(bits: int) -> None:
    """Packs, decoded values and quantized attention equal those of the former codec, which
    rotated with dense ``(D, D)`` matmuls (rebuilt here with numpy)."""
    mx.random.seed(4)
    B, n_heads, n_kv, L, S, D, scale = 1, 4, 2, 3, 40, 64, 0.125
    q, k, v = mx.random.normal((B, n_heads, L, D)), mx.random.normal((B, n_kv, S, D)), mx.random.normal((B, n_kv, S, D))
    dense = mx.array(sylvester_hadamard(D).astype(np.float32))
    codec = KVCodec(bits, 64)
    packs = codec.encode(v)
    dense_packs = mx.quantize(v @ dense, group_size=64, bits=bits)
    deq = lambda p: mx.dequantize(*p, group_size=64, bits=bits)  # noqa: E731
    step = float(mx.max(packs[1]))  # one quantization step: rounding may differ at ties only
    assert float(mx.abs(deq(packs) - deq(dense_packs)).max()) <= step * 1.01
    assert mx.allclose(codec.decode(dense_packs), deq(dense_packs) @ dense.T, atol=1e-5)
    kq, vq = codec.encode(k), packs
    got = codec.attention(q, kq, vq, scale, "causal")
    # the former computation: rotate the scaled queries, attend on the packs, rotate back
    qr = ((q * scale) @ dense).reshape(B, n_kv, 2, L, D)
    scores = mx.quantized_matmul(qr, *(mx.expand_dims(x, 2) for x in kq), transpose=True, group_size=64, bits=bits)
    mask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    probs = mx.softmax(mx.where(mask, scores, -mx.inf), axis=-1)
    out = mx.quantized_matmul(probs, *(mx.expand_dims(x, 2) for x in vq), transpose=False, group_size=64, bits=bits)
    ref = (out @ dense.T).reshape(B, n_heads, L, D)
    assert mx.allclose(got, ref, atol=1e-5, rtol=1e-4)


def test_quantized_decode_step_rotates_with_the_fast_hadamard_transform(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per layer and decoded token: four O(D log D) transforms (new key, new value, queries with the
    attention scale folded in, output) and no dense (D, D) rotation."""
    model = tiny_model()
    cache = make_cache(model, CacheSettings(kv_bits=4))
    run_chunks(model, tokens(10), cache, [10])
    calls: list[float | None] = []
    transform = mx.hadamard_transform

    def counting(x: mx.array, scale: float | None = None, **kwargs: object) -> mx.array:
        calls.append(scale)
        return transform(x, scale=scale, **kwargs)

    monkeypatch.setattr(mx, "hadamard_transform", counting)
    matmul_shapes: list[tuple[int, ...]] = []
    array_matmul = mx.array.__matmul__
    monkeypatch.setattr(mx.array, "__matmul__", lambda a, b: matmul_shapes.append(tuple(b.shape)) or array_matmul(a, b))
    run_chunks(model, tokens(1, seed=2), cache, [1])
    D = model.args.head_dim
    assert len(calls) == 4 * len(model.layers)
    assert calls.count(D**-0.5 / D**0.5) == len(model.layers)  # the queries: attention scale folded in
    assert (D, D) not in matmul_shapes


@pytest.mark.parametrize("bits,bound", [(8, 0.02), (4, 0.15)])
def test_quantized_cache_logits_close_to_float(bits: int, bound: float) -> None:
    model = tiny_model()  # 4 query heads over 2 kv heads: the GQA path
    ids = tokens(80)
    chunks = [33, 31] + [1] * 16  # two prefill chunks, then decode
    ref = mx.concatenate(run_chunks(model, ids, make_cache(model), chunks))
    got = mx.concatenate(run_chunks(model, ids, make_cache(model, CacheSettings(kv_bits=bits)), chunks))
    err = max_rel_error(got, ref)
    print(f"\n{bits}-bit tiny-model max relative logit error {err:.4f}")
    assert 0 < err < bound


def test_quantized_kv_start_switches_between_steps() -> None:
    model = tiny_model()
    ids = tokens(40)
    cache = make_cache(model, CacheSettings(kv_bits=8, quantized_kv_start=20))
    plain = make_cache(model)
    assert all(isinstance(c, KVCache) and not c.quantized for c in cache)
    before = run_chunks(model, ids[:20], cache, [12, 8])
    assert not cache[0].quantized
    assert mx.array_equal(mx.concatenate(before), mx.concatenate(run_chunks(model, ids[:20], plain, [12, 8])))
    float_bytes = cache[0].nbytes
    after = run_chunks(model, ids[20:], cache, [1] * 20)
    assert all(c.quantized for c in cache) and cache[0].offset == 40
    assert cache[0].nbytes < 0.6 * float_bytes
    ref = run_chunks(model, ids[20:], plain, [1] * 20)
    assert max_rel_error(mx.concatenate(after), mx.concatenate(ref)) < 0.02


def test_quantized_cache_memory_at_4k_tokens() -> None:
    model = tiny_model()
    B, n_kv, T, D = 1, model.args.num_key_value_heads, 4096, model.args.head_dim
    keys = mx.random.normal((B, n_kv, T, D)).astype(mx.float16)
    values = mx.random.normal((B, n_kv, T, D)).astype(mx.float16)

    def filled(settings: CacheSettings) -> int:
        cache = make_cache(model, settings)
        for c in cache:
            c.update_and_fetch(keys, values)
        mx.eval([c.state for c in cache])
        return sum(c.nbytes for c in cache)

    float16 = filled(CacheSettings())
    assert float16 == 2 * len(model.layers) * B * n_kv * T * D * 2  # bytes of fp16 keys + values
    ratio8, ratio4 = filled(CacheSettings(kv_bits=8)) / float16, filled(CacheSettings(kv_bits=4)) / float16
    print(f"\n4k-token cache size vs float16: 8-bit {ratio8:.3f}x, 4-bit {ratio4:.3f}x")
    assert ratio8 <= 0.55 and ratio4 <= 0.30


def test_bad_kv_settings_raise() -> None:
    model = tiny_model()
    with pytest.raises(MlxformerError):
        make_cache(model, CacheSettings(kv_bits=3))
    with pytest.raises(MlxformerError):
        make_cache(model, CacheSettings(kv_bits=4, kv_group_size=128))[0].update_and_fetch(
            mx.zeros((1, 2, 1, 64)), mx.zeros((1, 2, 1, 64))
        )


# --- rotating cache --------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [None, 4])
def test_rotating_cache_equals_unbounded_cache_while_it_fits(bits: int | None) -> None:
    model = tiny_model()
    ids = tokens(60)
    chunks = [25, 20] + [1] * 15
    rotating = make_cache(model, CacheSettings(kv_bits=bits, max_kv_size=64))
    assert isinstance(rotating[0], RotatingKVCache)
    got = mx.concatenate(run_chunks(model, ids, rotating, chunks))
    ref = mx.concatenate(run_chunks(model, ids, make_cache(model, CacheSettings(kv_bits=bits)), chunks))
    assert mx.allclose(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [None, 8])
def test_rotating_cache_without_sinks_is_a_sliding_window(bits: int | None) -> None:
    """keep=0: chunked prefill larger than the window, then decode, equals the uncached forward
    of the same weights as a Mistral sliding-window model (explicit window mask, no cache)."""
    window, n = 16, 70
    model = tiny_model()
    windowed = Model(ModelArgs.from_dict({**TINY, "model_type": "mistral", "sliding_window": window}))
    windowed.update(model.parameters())
    ids = tokens(n)
    ref = windowed(mx.array(ids)[None])[0]  # (n, V)
    cache = make_cache(model, CacheSettings(kv_bits=bits, max_kv_size=window, keep=0))
    got = mx.concatenate(run_chunks(model, ids, cache, [5, 30, 7] + [1] * 20 + [8]))
    if bits is None:
        assert mx.allclose(got, ref, atol=1e-4, rtol=1e-4)
    else:
        assert max_rel_error(got, ref) < 0.02
    assert cache[0].offset == n and cache[0].size == window


@pytest.mark.parametrize("bits", [None, 4])
def test_rotating_cache_chunked_prefill_equals_token_by_token(bits: int | None) -> None:
    """With attention sinks, a multi-token chunk that overflows the window sees exactly what
    one-token decoding through the ring buffer sees."""
    model = tiny_model()
    ids = tokens(50)
    settings = CacheSettings(kv_bits=bits, max_kv_size=20, keep=4)
    one_by_one = mx.concatenate(run_chunks(model, ids, make_cache(model, settings), [1] * 50))
    # The first chunk is one token in both runs: a quantized cache centers its keys on the
    # first chunk it stores, so equal first chunks make the two runs quantize identically.
    chunked = mx.concatenate(run_chunks(model, ids, make_cache(model, settings), [1, 8, 1, 1, 26, 1, 12]))
    assert mx.allclose(chunked, one_by_one, atol=1e-4, rtol=1e-4)
    # and the sinks matter: without them the logits after the window differ
    no_sinks = mx.concatenate(run_chunks(model, ids, make_cache(model, CacheSettings(kv_bits=bits, max_kv_size=20, keep=0)), [1] * 50))
    assert not mx.allclose(no_sinks[25:], one_by_one[25:], atol=1e-3)


def test_rotating_cache_generates_past_its_size_with_bounded_memory() -> None:
    model = tiny_model()
    cache = make_cache(model, CacheSettings(kv_bits=4, max_kv_size=48))
    sizes = []
    ids = tokens(20)
    run_chunks(model, ids, cache, [20])
    token = mx.array([ids[-1]])
    for _ in range(100):
        logits = model(token[None], cache)[0, -1]
        token = mx.argmax(logits)[None]
        mx.eval(token)
        sizes.append(sum(c.nbytes for c in cache))
    assert cache[0].offset == 120 and cache[0].size == 48
    assert max(sizes) == sizes[-1] and sizes[40] == sizes[-1]  # stops growing once full
    # The ring holds one token more than the next query sees, so one token can be trimmed
    # back; two would need an evicted one.
    assert cache[0].trim(2) == 0 and cache[0].offset == 120
    assert cache[0].trim(1) == 1 and cache[0].offset == 119


# --- prompt cache files ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [CacheSettings(), CacheSettings(kv_bits=8, quantized_kv_start=10), CacheSettings(kv_bits=4, max_kv_size=24)],
    ids=["float", "8bit-deferred", "4bit-rotating"],
)
def test_prompt_cache_save_load_continue(tmp_path: Path, settings: CacheSettings) -> None:
    model = tiny_model()
    ids = tokens(45)
    uninterrupted = run_chunks(model, ids, make_cache(model, settings), [30, 1, 1, 13])
    cache = make_cache(model, settings)
    run_chunks(model, ids[:30], cache, [30])
    path = tmp_path / "prompt.cache"  # any name: the file is read as safetensors explicitly
    save_prompt_cache(path, cache, ids[:30], model, TOKENIZER)
    assert [p.name for p in tmp_path.iterdir()] == ["prompt.cache"]  # written under exactly that name
    loaded, cached_ids = load_prompt_cache(path, model, TOKENIZER)
    assert cached_ids == ids[:30] and [type(c) for c in loaded] == [type(c) for c in cache]
    resumed = run_chunks(model, ids[30:], loaded, [1, 1, 13])
    for a, b in zip(resumed, uninterrupted[1:]):
        assert mx.allclose(a, b, atol=1e-5, rtol=1e-5)
    assert not list(tmp_path.glob(".*"))  # no temp file left behind


def test_prompt_cache_refuses_other_models_and_bad_files(tmp_path: Path) -> None:
    model = tiny_model()
    cache = make_cache(model)
    run_chunks(model, tokens(10), cache, [10])
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, cache, tokens(10), model, TOKENIZER)
    with pytest.raises(MlxformerError, match="different model config"):
        load_prompt_cache(path, tiny_model(num_hidden_layers=3), TOKENIZER)
    with pytest.raises(MlxformerError, match="different model config"):
        load_prompt_cache(path, tiny_model(rope_theta=500000.0), TOKENIZER)
    with pytest.raises(MlxformerError, match="exists"):
        save_prompt_cache(path, cache, tokens(10), model, TOKENIZER, overwrite=False)
    with pytest.raises(MlxformerError, match="not found"):
        load_prompt_cache(tmp_path / "missing.safetensors", model, TOKENIZER)
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(path.read_bytes()[:100])
    with pytest.raises(MlxformerError):
        load_prompt_cache(corrupt, model, TOKENIZER)
    arrays, metadata = mx.load(str(path), return_metadata=True)
    metadata["classes"] = json.dumps(["EvilCache"] * len(model.layers))
    mx.save_safetensors(str(tmp_path / "evil.safetensors"), arrays, metadata)
    with pytest.raises(MlxformerError, match="unknown cache class"):
        load_prompt_cache(tmp_path / "evil.safetensors", model, TOKENIZER)


def quantized_copy(model: Model, bits: int, group_size: int) -> Model:
    import copy

    import mlx.nn as nn

    quantized = copy.deepcopy(model)
    nn.quantize(quantized, group_size=group_size, bits=bits)
    mx.eval(quantized.parameters())
    return quantized


def test_prompt_cache_fingerprint_covers_weights_quantization_and_tokenizer(tmp_path: Path) -> None:
    """A cache is refused by a model of equal shapes but other weights (base vs instruct), by the
    same model quantized (or quantized otherwise), and under another vocabulary; it is accepted by
    the same model in another compute dtype."""
    model = tiny_model(seed=0)
    ids = tokens(10)
    path = tmp_path / "base.cache"
    cache_prompt(path, model, TOKENIZER, ids)
    with pytest.raises(MlxformerError, match="different model weights"):
        load_prompt_cache(path, tiny_model(seed=1), TOKENIZER)
    with pytest.raises(MlxformerError, match="different model quantization"):
        load_prompt_cache(path, quantized_copy(model, 4, 64), TOKENIZER)
    with pytest.raises(MlxformerError, match="different model tokenizer"):
        load_prompt_cache(path, model, tiny_tokenizer(renamed=7))
    assert load_prompt_cache(path, model, tiny_tokenizer())[1] == ids  # an equal tokenizer object
    in_bf16 = tiny_model(seed=0)  # the same weights, rounded: samples match within a bfloat16 step
    in_bf16.set_dtype(mx.bfloat16)
    mx.eval(in_bf16.parameters())
    assert load_prompt_cache(path, in_bf16, TOKENIZER)[1] == ids

    four_bit = quantized_copy(tiny_model(seed=0), 4, 64)
    cache_prompt(tmp_path / "q4.cache", four_bit, TOKENIZER, ids)
    with pytest.raises(MlxformerError, match="different model quantization"):
        load_prompt_cache(tmp_path / "q4.cache", tiny_model(seed=0), TOKENIZER)
    with pytest.raises(MlxformerError, match="different model quantization"):
        load_prompt_cache(tmp_path / "q4.cache", quantized_copy(tiny_model(seed=0), 4, 32), TOKENIZER)
    with pytest.raises(MlxformerError, match="different model quantization"):
        load_prompt_cache(tmp_path / "q4.cache", quantized_copy(tiny_model(seed=0), 8, 64), TOKENIZER)
    assert load_prompt_cache(tmp_path / "q4.cache", quantized_copy(tiny_model(seed=0), 4, 64), TOKENIZER)[1] == ids


@pytest.mark.parametrize(
    "made, requested, ok",
    [
        (CacheSettings(), CacheSettings(), True),
        (CacheSettings(), CacheSettings(kv_bits=8), False),
        (CacheSettings(), CacheSettings(max_kv_size=24), False),
        (CacheSettings(kv_bits=8), CacheSettings(), True),  # unset settings take the file's
        (CacheSettings(kv_bits=8), CacheSettings(kv_bits=8), True),
        (CacheSettings(kv_bits=8), CacheSettings(kv_bits=4), False),
        (CacheSettings(kv_bits=8), CacheSettings(kv_bits=8, kv_group_size=32), False),
        (CacheSettings(kv_bits=4, max_kv_size=24), CacheSettings(max_kv_size=24), True),
        (CacheSettings(kv_bits=4, max_kv_size=24), CacheSettings(max_kv_size=32), False),
        (CacheSettings(kv_bits=8, quantized_kv_start=5), CacheSettings(quantized_kv_start=6), False),
    ],
)
def test_prompt_cache_refuses_conflicting_cache_settings(
    tmp_path: Path, made: CacheSettings, requested: CacheSettings, ok: bool
) -> None:
    model = tiny_model()
    path = tmp_path / "p"
    cache_prompt(path, model, TOKENIZER, tokens(10), made)
    if ok:
        cache, _ = load_prompt_cache(path, model, TOKENIZER, requested)
        assert [c.meta_state for c in cache] == [c.meta_state for c in load_prompt_cache(path, model, TOKENIZER)[0]]
    else:
        with pytest.raises(MlxformerError, match="conflicts with the requested"):
            load_prompt_cache(path, model, TOKENIZER, requested)


def test_strip_cached_prefix() -> None:
    assert strip_cached_prefix([1, 2, 3, 4], [1, 2]) == [3, 4]
    with pytest.raises(MlxformerError, match="does not extend the cached one"):
        strip_cached_prefix([5, 6], [1, 2])  # would be appended after the cache
    with pytest.raises(MlxformerError, match="does not extend the cached one"):
        strip_cached_prefix([1], [1, 2])
    with pytest.raises(MlxformerError, match="entirely in the prompt cache"):
        strip_cached_prefix([1, 2], [1, 2])


# --- the real SmolLM2 -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm():
    from mlxformer.default_model import default_model_path
    from mlxformer.loader import load

    return load(default_model_path())


def chunked_perplexity(model: Model, ids: list[int], settings: CacheSettings, chunk: int = 64) -> float:
    """exp(mean NLL) of ``ids`` fed through a new cache in ``chunk``-token pieces."""
    return cached_perplexity(model, make_cache(model, settings), ids, chunk)


def test_quantized_cache_perplexity_on_smollm(smollm) -> None:
    """128 scored tokens of tests/data/eval.txt in two 64-token chunks, so the second chunk
    attends to 64 quantized cached tokens (the cost is ~0.2 s per token and cache setting on a
    2-core CPU). Measured here: 8-bit +0.18%, 4-bit +1.38% (over 256 tokens: +0.13%, +0.67%).

    Bounds are the issue's: 8-bit within 0.5%, 4-bit (group 64) within 3% of the float cache.
    (mlx-lm's plain min/max 4-bit cache loses +13.2% over 256 tokens; ours centers and rotates keys.)
    """
    model, tokenizer = smollm
    ids = tokenizer.encode(EVAL_TEXT.read_text())[:129]
    assert len(ids) == 129
    ppl = {
        "float": chunked_perplexity(model, ids, CacheSettings()),
        "8-bit": chunked_perplexity(model, ids, CacheSettings(kv_bits=8, kv_group_size=64)),
        "4-bit": chunked_perplexity(model, ids, CacheSettings(kv_bits=4, kv_group_size=64)),
    }
    print(f"\nSmolLM2-135M perplexity over {len(ids) - 1} tokens (64-token chunks): "
          + ", ".join(f"{k} {v:.4f}" for k, v in ppl.items())
          + f" | 8-bit {100 * (ppl['8-bit'] / ppl['float'] - 1):+.3f}%, 4-bit {100 * (ppl['4-bit'] / ppl['float'] - 1):+.3f}%")
    assert ppl["8-bit"] != ppl["float"]  # the quantized cache is really in use
    assert abs(ppl["8-bit"] / ppl["float"] - 1) < 0.005
    assert abs(ppl["4-bit"] / ppl["float"] - 1) < 0.03


def test_8bit_cache_greedy_matches_float_on_smollm(smollm) -> None:
    """16 greedy tokens per prompt agree; a divergence is tolerated only where the float
    model itself is at a near-tie (top-2 logit gap < 0.1 in an uncached forward).
    (On "def fibonacci(n):" token 25 has a 0.07 gap, and mlx-lm's 8-bit cache flips it too.)"""
    model, tokenizer = smollm
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    near_ties = []
    for prompt in prompts:
        ref, got = (
            [r.token for r in stream_generate(model, tokenizer, prompt, 16, cache_settings=settings)]
            for settings in (CacheSettings(), CacheSettings(kv_bits=8))
        )
        assert len(ref) >= 8
        if got == ref:
            continue
        d = next(i for i, (a, b) in enumerate(zip(ref, got)) if a != b)
        logits = model(mx.array(tokenizer.encode(prompt) + ref[:d])[None])[0, -1]
        top2 = mx.sort(logits)[-2:]
        gap = float(top2[1] - top2[0])
        near_ties.append((prompt, d, gap))
        assert gap < 0.1, f"{prompt!r}: 8-bit cache diverged at token {d} where the float top-2 gap is {gap:.3f}"
    print(f"\n8-bit greedy divergences, all at float near-ties (prompt, token, gap): {near_ties}")


def test_cli_cache_prompt_then_generate(
    tiny_dirs: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On the tiny "base" model over SmolLM2's tokenizer and chat template (the CLI's plumbing is
    checked; SmolLM2 itself made this ~30 s)."""
    out = tmp_path / "sys.safetensors"
    prompt = "Name three primary colors."
    model = ["-m", str(tiny_dirs[0])]
    base = [*model, "--max-tokens", "6", "--prompt", prompt]
    assert main(["cache-prompt", *model, "--prompt", prompt, "--prompt-cache-file", str(out), "--kv-bits", "8"]) == 0
    assert out.is_file()
    capsys.readouterr()
    assert main(["cache-prompt", *model, "--prompt", prompt, "--prompt-cache-file", str(out)]) == 1
    assert "exists" in capsys.readouterr().err
    assert main(["cache-prompt", *model, "--prompt", prompt, "--prompt-cache-file", str(out), "--force"]) == 0
    assert capsys.readouterr().err.endswith(f"to {out} ({out.stat().st_size / 1e6:.2f} MB)\n")  # the file's size
    assert main(["generate", *base, "--prompt-cache-file", str(out)]) == 0
    cached = capsys.readouterr()
    assert main(["generate", *base]) == 0
    fresh = capsys.readouterr()
    assert cached.out == fresh.out and cached.out.strip()
    # the statistics count the whole prompt, cached prefix included, both times
    prompt_tokens = [int(s.split()[1]) for s in (cached.err, fresh.err)]
    assert prompt_tokens[0] == prompt_tokens[1] > 6
    # the cached user turn is left open, so a longer prompt that starts with it continues it (as
    # mlx-lm's cache_prompt): the cache holds the prompt's text but not its end of turn
    longer = [*model, "--max-tokens", "6", "--prompt", prompt + " Then name a secondary one."]
    assert main(["generate", *longer, "--prompt-cache-file", str(out)]) == 0
    cached = capsys.readouterr()
    assert main(["generate", *longer]) == 0
    assert cached.out == capsys.readouterr().out and cached.out.strip()


@pytest.fixture(scope="module")
def tiny_dirs(smollm, tmp_path_factory) -> tuple[Path, Path, Path]:
    """Tiny random Llamas over SmolLM2's tokenizer: a "base", an "instruct" of equal shapes and
    other weights, and the base quantized to 4 bits."""
    from conftest import write_tiny_checkpoint
    from mlxformer import convert

    dirs = []
    for seed in (0, 1):
        directory, _ = write_tiny_checkpoint(
            tmp_path_factory.mktemp(f"tiny{seed}"), "llama", seed=seed, vocab_size=49152, head_dim=64,
            tie_word_embeddings=True,
        )
        smollm[1].save(directory)
        dirs.append(directory)
    q4 = tmp_path_factory.mktemp("q4") / "q4"
    convert(dirs[0], q4, quantize=True, q_bits=4, q_group_size=32, quant_recipe="rtn", progress=False)
    return dirs[0], dirs[1], q4


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mlxformer: error:"), err
    return err


def test_cli_prompt_cache_file_of_any_name_and_refusals(
    tiny_dirs: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--prompt-cache-file p.cache`` round-trips; another model's weights, another quantization,
    cache flags that conflict with the file's cache and a prompt that does not extend the cached
    one are one-line errors with exit status 1."""
    base, instruct, q4 = tiny_dirs
    prompt = "Name three primary colors."
    cache = tmp_path / "p.cache"
    assert main(["cache-prompt", "-m", str(base), "--prompt", prompt, "--prompt-cache-file", str(cache)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["p.cache"]
    gen = ["generate", "--max-tokens", "4", "--prompt", prompt]
    capsys.readouterr()
    assert main([*gen, "-m", str(base), "--prompt-cache-file", str(cache)]) == 0
    cached = capsys.readouterr()
    assert main([*gen, "-m", str(base)]) == 0
    fresh = capsys.readouterr()
    assert cached.out == fresh.out and cached.out.strip()
    for flags, message in [
        (["-m", str(instruct)], "different model weights"),
        (["-m", str(q4)], "different model quantization"),
        (["-m", str(base), "--kv-bits", "8"], "conflicts with the requested kv_bits=8"),
        (["-m", str(base), "--max-kv-size", "64"], "conflicts with the requested"),
        (["-m", str(base), "--system", "Answer in French."], "does not extend the cached one"),
    ]:
        assert main([*gen, *flags, "--prompt-cache-file", str(cache)]) == 1, flags
        assert message in one_line_error(capsys), flags
    # a cache made with the flags is used with the same flags or none
    assert main(["cache-prompt", "-m", str(base), "--prompt", prompt, "--prompt-cache-file", str(cache),
                 "--force", "--kv-bits", "8", "--max-kv-size", "64"]) == 0
    for flags in ([], ["--kv-bits", "8", "--max-kv-size", "64"]):
        assert main([*gen, "-m", str(base), *flags, "--prompt-cache-file", str(cache)]) == 0
    capsys.readouterr()
    assert main([*gen, "-m", str(base), "--kv-bits", "4", "--prompt-cache-file", str(cache)]) == 1
    assert "kv_bits=8" in one_line_error(capsys)
