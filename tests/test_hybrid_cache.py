"""The prompt cache of a hybrid (Gated DeltaNet) model in the engine: state snapshots at every
prefill chunk's end (chunks cut at multiples of the chunk size), so a prompt that leaves a cached
one mid-turn resumes from the last block boundary before that point, and the disk tier keeping
those snapshots beside the blocks across a restart.

The reference is a cold engine (no prompt cache) on the same prompt: the resumed request runs
the same chunks from the snapshot on, so its tokens and log-probabilities equal the cold ones bit
for bit, with float and with 8-bit keys/values. Tiny random ``qwen3_5_text`` (3 DeltaNet layers,
1 attention layer) written by transformers.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from conftest import cpu_default_device, write_byte_tokenizer, write_tiny_checkpoint
from mlxformer import load
from mlxformer.cache import CacheSettings
from mlxformer.engine import Engine, GenerationRequest
from mlxformer.engine.prompt_cache import PromptCacheSettings

HYBRID = dict(num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=12, linear_value_head_dim=10, linear_conv_kernel_dim=4)
CHUNK = 32  # prefill chunk = block size: a snapshot at every block boundary a prefill crosses
STORAGE = {"float": CacheSettings(), "q8": CacheSettings(kv_bits=8, kv_group_size=32)}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    with cpu_default_device():
        directory, _ = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5_text", **HYBRID)
        write_byte_tokenizer(directory)
        model, tokenizer = load(directory, dtype=mx.float32, threads=1)
        tokenizer.eos_token_ids = []
        yield model, tokenizer


def ids(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 256, size=n)]


def run(engine: Engine, prompt: list[int], n: int = 6) -> tuple[list[int], list[float], int]:
    """Greedy tokens, their log-probabilities and the prompt tokens served from the cache."""
    events = [e for e in engine.submit(GenerationRequest(prompt, n, logprobs=0)) if e.token is not None]
    return [e.token for e in events], [e.logprob for e in events], events[-1].cached_tokens


def cold(hybrid, settings: CacheSettings, prompt: list[int]) -> tuple[list[int], list[float], int]:
    model, tokenizer = hybrid
    with cpu_default_device(), Engine(model, tokenizer, prefill_chunk=CHUNK, cache_settings=settings,
                                      prefix_cache_bytes=0) as engine:
        return run(engine, prompt)


def sample(engine: Engine, name: str) -> float:
    return engine.metrics.registry.get_sample_value(name) or 0.0


@pytest.mark.parametrize("storage", list(STORAGE))
def test_a_prompt_leaving_a_cached_one_mid_turn_resumes_from_an_inner_block(hybrid, storage):
    """A 100-token prompt is cached with snapshots at 32, 64 and 96; a prompt sharing its first 80
    tokens resumes at 64 (prefills only the rest) and decodes exactly as a cold engine does."""
    model, tokenizer = hybrid
    settings = STORAGE[storage]
    first = ids(100, seed=1)
    second = first[:80] + ids(30, seed=2)
    with cpu_default_device(), Engine(model, tokenizer, prefill_chunk=CHUNK, cache_settings=settings,
                                      prefix_cache_bytes=10**8) as engine:
        run(engine, first)
        prefilled = sample(engine, "mlxformer_prefilled_tokens_total")
        tokens, logprobs, cached = run(engine, second)
        assert cached == 64
        assert sample(engine, "mlxformer_prefilled_tokens_total") - prefilled == len(second) - 64
    assert (tokens, logprobs, 0) == cold(hybrid, settings, second)  # bit for bit


def test_a_turn_whose_history_drops_the_reply_resumes_at_the_previous_prompts_end(hybrid):
    """The client sends the previous turn back with another reply (a template dropping its
    reasoning): the new prompt resumes at the previous prompt's end (its snapshot), not at the
    last chunk boundary, and decodes exactly as a cold engine does."""
    model, tokenizer = hybrid
    first = ids(90, seed=5)
    with cpu_default_device(), Engine(model, tokenizer, prefill_chunk=CHUNK, prefix_cache_bytes=10**8) as engine:
        reply, _, _ = run(engine, first)
        second = first + [t + 1 for t in reply] + ids(20, seed=6)
        tokens, logprobs, cached = run(engine, second)
    assert cached == 90
    assert tokens == cold(hybrid, CacheSettings(), second)[0]


@pytest.mark.parametrize("storage", list(STORAGE))
def test_the_disk_tier_keeps_snapshots_across_a_restart(hybrid, tmp_path, storage):
    """A 4-turn conversation on a disk-backed cache: after a restart (memory empty) each new
    turn resumes from the last block boundary of the cached conversation (its tail is in memory
    only), served from disk, and decodes exactly as a cold engine; /metrics shows the hit rate."""
    model, tokenizer = hybrid
    settings = STORAGE[storage]
    tiers = PromptCacheSettings(memory_bytes=10**8, directory=str(tmp_path), block_size=32)
    turn = ids(70, seed=3)
    with cpu_default_device(), Engine(model, tokenizer, prefill_chunk=CHUNK, cache_settings=settings,
                                      prompt_cache=tiers) as engine:
        reply, _, _ = run(engine, turn)
    assert len(list(tmp_path.glob("*.state.safetensors"))) == 2  # snapshots at 32 and 64 (70 is a tail)
    for i in range(3):  # each turn: the previous prompt, its reply and a new message
        turn = turn + reply + ids(25, seed=4 + i)
        with cpu_default_device(), Engine(model, tokenizer, prefill_chunk=CHUNK, cache_settings=settings,
                                          prompt_cache=tiers) as engine:
            tokens, logprobs, cached = run(engine, turn)
            assert cached == (len(turn) - 25 - len(reply)) // 32 * 32  # the previous prompt's last block
            assert engine.prefix_cache.disk_tokens == cached
            assert sample(engine, "mlxformer_prefix_cache_hit_ratio") == pytest.approx(cached / len(turn))
        assert (tokens, logprobs, 0) == cold(hybrid, settings, turn)
        reply = tokens


@pytest.mark.parametrize("storage", list(STORAGE))
@pytest.mark.parametrize("batched", [False, True])
def test_a_turn_carrying_the_generated_reply_prefills_only_the_new_message(hybrid, storage, batched):
    """What an agent sends: turn 1's prompt, the reply the engine generated (verbatim) and a new
    message. The turn resumes where turn 1's sequence ended (its state snapshot kept when it
    retired; ``batched``: retired from a batch row beside another request), so only the new
    message is prefilled: the engine's overlapped step (queued before the last token was read)
    fed the reply's last token too, and a recurrent state cannot give it back, so it is kept
    with every token it holds (engine/departures.py ``_keep``). The tokens equal a cold
    engine's; the log-probabilities agree to float32 rounding, not bit for bit: the reply's
    states were computed one decode step at a time (the recurrent form), a cold engine computes
    them inside a prefill chunk (the chunked form), which sums in another order."""
    model, tokenizer = hybrid
    settings = STORAGE[storage]
    first, other = ids(77, seed=7), ids(50, seed=8)
    with cpu_default_device(), Engine(model, tokenizer, prefill_chunk=CHUNK, cache_settings=settings,
                                      prefix_cache_bytes=10**8) as engine:
        if batched:
            with engine._wake:  # together: one batch decodes both
                handles = [engine.submit(GenerationRequest(p, 9)) for p in (first, other)]
            reply = [e.token for e in handles[0] if e.token is not None]
            list(handles[1])
        else:
            reply, _, _ = run(engine, first, 9)
        message = ids(23, seed=9)
        second = first + reply + message
        prefilled = sample(engine, "mlxformer_prefilled_tokens_total")
        tokens, logprobs, cached = run(engine, second)
        assert cached == len(first) + len(reply)
        assert sample(engine, "mlxformer_prefilled_tokens_total") - prefilled == len(message)
    cold_tokens, cold_logprobs, _ = cold(hybrid, settings, second)
    assert tokens == cold_tokens
    assert np.allclose(logprobs, cold_logprobs, rtol=0, atol=1e-4)
