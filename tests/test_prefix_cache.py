"""The tiered prompt cache: hash-chained blocks shared between prompts (partial hits, each block
counted once), LRU in memory and on disk, reuse after a restart, and files that must not be used
(truncated, another model's, a write killed half-way) skipped and removed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest

from conftest import write_tiny_byte_llama
from pool_support import held, seated
from mlxformer import load, stream_generate
from mlxformer.cache import CacheSettings, make_cache
from mlxformer.engine import Engine, GenerationRequest
from mlxformer.engine.prompt_cache import PromptCacheSettings, build_prefix_cache

BLOCK = 8
SETTINGS = {
    "float": CacheSettings(),
    "kv8": CacheSettings(kv_bits=8, kv_group_size=32),
    "rotating": CacheSettings(max_kv_size=48, keep=2),
}


def prefilled(model, tokens, settings=None):
    cache = make_cache(model, settings)
    mx.eval(model.last_logits(mx.array([tokens]), cache))
    return cache


def tiers(model, tokenizer, settings=None, memory=2**30, directory=None, disk=2**30):
    return build_prefix_cache(model, tokenizer, settings or CacheSettings(),
                              PromptCacheSettings(memory, None if directory is None else str(directory), disk, BLOCK),
                              mx.float32)


SYSTEM = list(range(10, 34))  # 3 blocks


def block_files(directory: Path) -> list[Path]:
    """The block files (not the temporaries of writes in progress)."""
    return [p for p in directory.glob("*.safetensors") if not p.name.startswith(".")]


@pytest.mark.parametrize("cache", list(SETTINGS))
def test_shared_blocks_partial_hit_and_exact_logits(tiny_byte_llama, cache):
    """Two prompts share a 3-block system prompt: the second one's hit is those blocks (stored
    once), and the caches rebuilt from them give exactly the logits of the first prompt's own
    cache cut back to the system prompt."""
    model, tokenizer = tiny_byte_llama
    settings = SETTINGS[cache]
    prefix = tiers(model, tokenizer, settings)
    first = SYSTEM + list(range(40, 48))  # 4 blocks
    prefix.insert(first, held(prefilled(model, first, settings)))
    assert len(prefix) == 4
    one_block = prefix.nbytes // len(prefix)
    second = SYSTEM + list(range(60, 70))
    hit, n = prefix.lookup(second)
    caches = seated(model, hit)
    assert n == len(SYSTEM) and caches[0].offset == n
    got = model.last_logits(mx.array([second[n:]]), caches)
    reference = prefilled(model, first, settings)  # the first prompt's own cache, cut back to the system prompt
    assert all(c.trim(len(first) - n) == len(first) - n for c in reference)
    want = model.last_logits(mx.array([second[n:]]), reference)
    assert mx.array_equal(got, want).item()
    # the second prompt's own cache adds only its own block and its 2-token tail (issue 19:
    # shared buffers counted twice)
    prefix.insert(second, held(prefilled(model, second, settings)))
    tails = [b for b in prefix.blocks.values() if len(b.tokens) < BLOCK]
    assert len(prefix) == 4 + 2 and [b.tokens for b in tails] == [(68, 69)]
    assert prefix.nbytes == 5 * one_block + tails[0].nbytes
    prefix.insert(second, held(caches))  # a hit's caches put back: nothing new
    assert prefix.nbytes == 5 * one_block + tails[0].nbytes


@pytest.mark.parametrize("cache", list(SETTINGS))
def test_a_hit_is_the_exact_common_prefix(tiny_byte_llama, cache):
    """Past the last shared whole block a hit goes on into the cached block that shares most
    tokens with the prompt (a finished sequence's partial tail, or a full block of a prompt that
    went another way), as mlx-lm's prompt cache trims to the common prefix; the caches give the
    logits of the first prompt's own cache cut back to that prefix."""
    model, tokenizer = tiny_byte_llama
    settings = SETTINGS[cache]
    prefix = tiers(model, tokenizer, settings)
    first = SYSTEM + list(range(40, 48)) + [50, 51, 52]  # 4 blocks and a 3-token tail
    prefix.insert(first, held(prefilled(model, first, settings)))
    for prompt, shared in ((first[:-1] + [99, 98], 34), (SYSTEM + [40, 41, 42, 77], 27), (first, 34),
                           (first[:27], 26), ([10, 11, 5], 2)):
        hit, n = prefix.lookup(prompt)
        caches = seated(model, hit)
        assert n == shared and caches[0].offset == n
        got = model.last_logits(mx.array([prompt[n:]]), caches)
        reference = prefilled(model, first, settings)
        assert all(c.trim(len(first) - n) == len(first) - n for c in reference)
        assert mx.array_equal(got, model.last_logits(mx.array([prompt[n:]]), reference)).item()
    assert prefix.lookup([7, 8, 9]) is None


def test_shorter_prefix_serves_when_the_longest_cannot(tiny_byte_llama):
    """Issue 19: a rotating cache that has evicted tokens is not a prefix; a shorter one that
    shares the prompt's start still serves it."""
    model, tokenizer = tiny_byte_llama
    settings = SETTINGS["rotating"]
    prefix = tiers(model, tokenizer, settings)
    long = SYSTEM + list(range(100, 140))  # 64 tokens > the 48-token window: evicted
    prefix.insert(long, held(prefilled(model, long, settings)))
    assert len(prefix) == 0
    short = SYSTEM + [100, 101]
    prefix.insert(short, held(prefilled(model, short, settings)))
    caches, n = prefix.lookup(long)
    assert n == len(short)


def test_memory_lru_at_the_byte_bound(tiny_byte_llama):
    model, tokenizer = tiny_byte_llama
    probe = tiers(model, tokenizer)
    a, b, c = ([i] * 16 for i in (1, 2, 3))  # 2 blocks each
    probe.insert(a, held(prefilled(model, a)))
    block = probe.nbytes // 2
    prefix = tiers(model, tokenizer, memory=4 * block)
    prefix.insert(a, held(prefilled(model, a)))
    prefix.insert(b, held(prefilled(model, b)))
    assert prefix.lookup(a + [9])[1] == 16  # a is now the most recent
    prefix.insert(c, held(prefilled(model, c)))  # b goes
    assert prefix.nbytes == 4 * block
    assert prefix.lookup(b + [9]) is None and prefix.lookup(c + [9])[1] == 16
    prefix.evict_to(block)  # the budget's interface: tails first, so a chain keeps its start
    assert prefix.nbytes == block and prefix.lookup(c + [9])[1] == BLOCK


def test_eviction_leaves_no_child_index_behind(tiny_byte_llama):
    """Many distinct prompts through a cache that holds two of them: the child index (parent key
    -> blocks cached after it) holds only the blocks in memory, not one entry per prompt ever seen."""
    model, tokenizer = tiny_byte_llama
    probe = tiers(model, tokenizer)
    probe.insert([1] * 16, held(prefilled(model, [1] * 16)))
    prefix = tiers(model, tokenizer, memory=probe.nbytes * 2)
    for i in range(40):
        tokens = [40 + i] * 12 + [7] * 6  # a full block and a tail, each prompt its own chain
        prefix.insert(tokens, held(prefilled(model, tokens)))
    children = [key for keys in prefix._children.values() for key in keys]
    assert sorted(children) == sorted(prefix.blocks) and len(prefix._children) <= len(prefix.blocks)


def test_engine_serves_a_prefix_shorter_than_a_block(tiny_byte_llama):
    """A system prompt shorter than a block, and a prompt sent again, are served from the cache
    (mlx-lm's server reuses both); each output is the one it gets alone."""
    model, tokenizer = tiny_byte_llama
    short_system = SYSTEM[:5]
    first, second = short_system + list(range(40, 50)), short_system + list(range(60, 66))
    with Engine(model, tokenizer, prompt_cache=PromptCacheSettings(block_size=BLOCK)) as engine:
        for prompt, cached in ((first, 0), (second, 5), (first, len(first) - 1)):
            events = list(engine.submit(GenerationRequest(prompt, max_tokens=5)))
            assert events[-1].cached_tokens == cached
            assert [e.token for e in events] == [r.token for r in stream_generate(model, tokenizer, prompt, 5)]


def test_engine_reuses_the_disk_after_a_restart(tiny_byte_llama, tmp_path):
    """A new engine on the same directory serves the prompt's blocks from disk; the request's
    ``cached_tokens`` counts them and its output is the one it gets alone."""
    model, tokenizer = tiny_byte_llama
    prompt = SYSTEM + list(range(40, 52))
    request = GenerationRequest(prompt, max_tokens=6)
    alone = [r.token for r in stream_generate(model, tokenizer, prompt, 6)]
    disk = PromptCacheSettings(memory_bytes=2**30, directory=str(tmp_path), block_size=BLOCK)
    with Engine(model, tokenizer, prompt_cache=disk) as engine:
        events = list(engine.submit(request))
    assert events[-1].cached_tokens == 0
    assert len(block_files(tmp_path)) == (len(prompt) + 5) // BLOCK
    with Engine(model, tokenizer, prompt_cache=disk) as engine:  # a restart: memory empty
        events = list(engine.submit(request))
        assert engine.prefix_cache.disk_tokens == 32
    assert events[-1].cached_tokens == 32
    assert [e.token for e in events] == alone


def test_disk_lru_at_the_byte_bound(tiny_byte_llama, tmp_path):
    model, tokenizer = tiny_byte_llama
    first = tiers(model, tokenizer, memory=0, directory=tmp_path / "probe")
    first.insert([1] * 8, held(prefilled(model, [1] * 8)))
    first.flush()
    size = block_files(tmp_path / "probe")[0].stat().st_size
    prefix = tiers(model, tokenizer, memory=0, directory=tmp_path / "lru", disk=int(2.5 * size))
    for i in (1, 2, 3):
        prefix.insert([i] * 8, held(prefilled(model, [i] * 8)))
        prefix.flush()
        if i == 2:
            assert prefix.lookup([1] * 8 + [0])[1] == 8  # 1 becomes the most recent
    assert prefix.lookup([2] * 8 + [0]) is None  # the least recently used file went
    assert prefix.lookup([1] * 8 + [0])[1] == 8 and prefix.lookup([3] * 8 + [0])[1] == 8
    assert len(block_files(tmp_path / "lru")) == 2


def test_bad_files_are_skipped_and_removed(tiny_byte_llama, tmp_path, tmp_path_factory):
    model, tokenizer = tiny_byte_llama
    prompt = SYSTEM + [1]
    prefix = tiers(model, tokenizer, memory=0, directory=tmp_path)
    prefix.insert(prompt, held(prefilled(model, prompt)))
    prefix.flush()
    keys = prefix.keys_for(prompt)
    files = [tmp_path / f"{k}.safetensors" for k in keys]
    data = files[1].read_bytes()
    files[1].write_bytes(data[: len(data) // 2])  # truncated
    other_model, other_tokenizer = load(write_tiny_byte_llama(tmp_path_factory.mktemp("other"), 1), dtype=mx.float32)
    other = tiers(other_model, other_tokenizer, memory=0, directory=tmp_path / "other")
    other.insert(prompt, held(prefilled(other_model, prompt)))
    other.flush()
    other_file = tmp_path / "other" / f"{other.keys_for(prompt)[0]}.safetensors"
    os.replace(other_file, files[0])  # another model's block under our first block's name
    restarted = tiers(model, tokenizer, memory=0, directory=tmp_path)
    assert restarted.lookup(prompt) is None  # block 0 is foreign: nothing is used
    assert not files[0].exists() and files[1].exists() and files[2].exists()
    fresh = prefilled(model, SYSTEM[:8])
    restarted.insert(SYSTEM[:8], held(fresh))
    restarted.flush()
    assert restarted.lookup(prompt)[1] == BLOCK  # block 1 is truncated: the hit stops before it
    assert not files[1].exists()


def test_a_write_killed_half_way_leaves_no_entry(tiny_byte_llama, tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    write_tiny_byte_llama(model_dir, 0)
    cache_dir = tmp_path / "cache"
    script = textwrap.dedent(f"""
        import os, signal
        import mlx.core as mx
        from mlxformer import load
        from mlxformer.cache import CacheSettings, make_cache
        from mlxformer.engine.prompt_cache import PromptCacheSettings, build_prefix_cache

        def half_then_die(path, arrays, metadata):
            with open(path, "wb") as f:
                f.write(b"\\x00" * 1000)
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        mx.save_safetensors = half_then_die
        model, tokenizer = load({str(model_dir)!r}, dtype=mx.float32)
        prefix = build_prefix_cache(model, tokenizer, CacheSettings(),
                                    PromptCacheSettings(0, {str(cache_dir)!r}, 2**30, {BLOCK}), mx.float32)
        cache = make_cache(model)
        tokens = list(range(10, 18))
        mx.eval(model.last_logits(mx.array([tokens]), cache))
        prefix.insert(tokens, [c.held() for c in cache])
        prefix.flush()
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    assert result.returncode == -9, result.stderr.decode()[-2000:]
    assert [p.name for p in cache_dir.iterdir()] and not block_files(cache_dir)
    model, tokenizer = tiny_byte_llama
    restarted = tiers(model, tokenizer, memory=0, directory=cache_dir)
    assert restarted.lookup(list(range(10, 19))) is None
    assert not list(cache_dir.iterdir())  # the temporary was removed at start


@pytest.mark.parametrize("share", [True, False])
def test_requests_sharing_a_prefix_prefill_it_once(tiny_byte_llama, share):
    """Four requests sharing a 3-block system prompt arrive together: with sharing, the prefix is
    prefilled once (the others wait for its blocks); without, four times. Outputs are the same."""
    model, tokenizer = tiny_byte_llama
    tails = [[40 + i, 50 + i, 60 + i] for i in range(4)]
    requests = [GenerationRequest(SYSTEM + t, max_tokens=5) for t in tails]
    alone = [[r.token for r in stream_generate(model, tokenizer, q.prompt_ids, 5)] for q in requests]
    tiers_ = PromptCacheSettings(memory_bytes=2**30, block_size=BLOCK, share_prefills=share)
    with Engine(model, tokenizer, max_batch=4, prefill_chunk=BLOCK, prompt_cache=tiers_) as engine:
        with engine._wake:  # together: the loop sees all four in one step (a loaded machine may step between submits)
            handles = [engine.submit(r) for r in requests]
        got = [[e.token for e in h] for h in handles]
        prefilled = engine.metrics.registry.get_sample_value("mlxformer_prefilled_tokens_total")  # /metrics
    assert got == alone
    assert prefilled == (len(SYSTEM) + sum(map(len, tails)) if share else sum(len(r.prompt_ids) for r in requests))
