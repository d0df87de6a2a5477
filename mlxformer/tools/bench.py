"""Benchmarking: prefill and decode throughput and peak memory on random prompts."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import mlx.core as mx

from mlxformer.cache import CacheSettings
from mlxformer.generation.decoding import open_sequence
from mlxformer.errors import MlxformerError
from mlxformer.generation.stream import decode
from mlxformer.models.decoder import Model
from mlxformer.speculative.speculator import SpeculativeSettings, SpeculativeStats, check_draft
from mlxformer.text.tokenizer import Tokenizer

# A token stream: given a prompt (T,) and a count, yields that many generated token ids.
TokenLoop = Callable[[mx.array, int], Iterator[int]]


@dataclass(frozen=True)
class Trial:
    """One measured generation: prefill and decode throughput, peak memory."""

    prompt_tokens: int
    generation_tokens: int
    prefill_tps: float
    decode_tps: float
    peak_memory_gb: float
    proposed_tokens: int = 0  # speculative decoding only
    accepted_tokens: int = 0


def measure(
    token_loop: TokenLoop, prompt: mx.array, generation_tokens: int, stats: SpeculativeStats | None = None
) -> Trial:
    """Time ``token_loop``: prefill = time to the first token, decode = the rest per token.
    ``stats``, if the loop speculates into it, gives the trial's proposed/accepted counts."""
    before = (stats.proposed, stats.accepted) if stats is not None else (0, 0)
    mx.synchronize()
    mx.reset_peak_memory()
    start = time.perf_counter()
    first = start
    count = 0
    for count, _ in enumerate(token_loop(prompt, generation_tokens), start=1):
        if count == 1:
            first = time.perf_counter()
    end = time.perf_counter()
    return Trial(
        prompt_tokens=prompt.size,
        generation_tokens=count,
        prefill_tps=prompt.size / (first - start),
        decode_tps=(count - 1) / (end - first) if count > 1 else 0.0,
        peak_memory_gb=mx.get_peak_memory() / 1e9,
        proposed_tokens=stats.proposed - before[0] if stats is not None else 0,
        accepted_tokens=stats.accepted - before[1] if stats is not None else 0,
    )


def mlxformer_loop(
    model: Model,
    settings: CacheSettings | None = None,
    speculative: SpeculativeSettings | None = None,
    tokenizer: Tokenizer | None = None,
    stats: SpeculativeStats | None = None,
) -> TokenLoop:
    """mlxformer's greedy generation loop over a fresh cache (eos is not checked); with
    ``speculative`` (and the target's ``tokenizer``), the speculative loop counting into ``stats``."""
    if speculative is not None and tokenizer is not None:
        check_draft(speculative, tokenizer)

    def loop(prompt: mx.array, n: int) -> Iterator[int]:
        spec = speculative if tokenizer is not None else None
        state = open_sequence(model, prompt.tolist(), eos_ids=(), detokenizer=None, max_tokens=n,
                              cache_settings=settings, speculative=spec)
        for token, _ in decode(model, state):
            yield token
        if state.speculator is not None and stats is not None:
            stats.proposed += state.speculator.stats.proposed
            stats.accepted += state.speculator.stats.accepted
            stats.rounds += state.speculator.stats.rounds

    return loop


def random_prompt(vocab_size: int, length: int, seed: int = 0) -> mx.array:
    """A reproducible random prompt of ``length`` token ids."""
    return mx.random.randint(0, vocab_size, (length,), key=mx.random.key(seed))


def median_trial(trials: list[Trial]) -> Trial:
    """Field-wise median of several trials."""
    return Trial(
        prompt_tokens=trials[0].prompt_tokens,
        generation_tokens=trials[0].generation_tokens,
        prefill_tps=statistics.median(t.prefill_tps for t in trials),
        decode_tps=statistics.median(t.decode_tps for t in trials),
        peak_memory_gb=statistics.median(t.peak_memory_gb for t in trials),
        proposed_tokens=sum(t.proposed_tokens for t in trials),
        accepted_tokens=sum(t.accepted_tokens for t in trials),
    )


def run_benchmark(
    model: Model, settings: CacheSettings | None, prompt_tokens: int, generation_tokens: int, trials: int,
    on_trial: Callable[[Trial], None] | None = None,
    speculative: SpeculativeSettings | None = None,
    tokenizer: Tokenizer | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> tuple[list[Trial], Trial]:
    """Warm up, then ``trials`` greedy generations of ``generation_tokens`` after a random
    ``prompt_tokens`` prompt; returns every trial and their median (whose proposed/accepted
    counts are the trials' sums). ``on_progress`` is told what starts (the warm-up, each trial)."""
    tell = on_progress or (lambda message: None)
    if prompt_tokens < 1 or generation_tokens < 2 or trials < 1:
        raise MlxformerError("need --prompt-tokens >= 1, --generation-tokens >= 2 and --trials >= 1")
    stats = SpeculativeStats()
    loop = mlxformer_loop(model, settings, speculative, tokenizer, stats)
    prompt = random_prompt(model.args.vocab_size, prompt_tokens)
    tell("warming up")
    measure(loop, prompt[:16], 4)
    results = []
    for trial in range(1, trials + 1):
        tell(f"trial {trial}/{trials}: {prompt_tokens} prompt tokens, then {generation_tokens} generated")
        results.append(measure(loop, prompt, generation_tokens, stats))
        if on_trial is not None:
            on_trial(results[-1])
    return results, median_trial(results)
