"""Checks every family's tests run on a tiny checkpoint: transformers' logits, chunked prefill then
decode through the caches, and greedy identity of an engine batch and of prompt-lookup
speculation with plain decoding alone."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np



def tokens(n: int, seed: int = 1) -> np.ndarray:
    """``n`` random ids of a byte-tokenizer test model (above its special ids)."""
    return np.random.default_rng(seed).integers(3, 256, size=n)


PROMPTS = ["Once upon a time, in a land far away,", "abcabcabcabc", "The quick brown fox jumps over"]


def hf_logits(hf_model: Any, ids: np.ndarray) -> np.ndarray:
    """transformers' logits ``(T, vocab)`` of ``ids`` in one forward."""
    import torch

    with torch.no_grad():
        return hf_model(torch.tensor(ids[None])).logits[0].numpy()


def chunked_then_decoded(model: Any, ids: np.ndarray, prefilled: int, cache: Any = None, step_size: int = 7) -> np.ndarray:
    """Our logits of ``ids[prefilled - 1:]``: the first ``prefilled`` tokens prefilled in chunks of
    ``step_size``, the rest decoded one at a time through the same caches (``cache``: new float
    caches unless given)."""
    from mlxformer.cache import CacheSettings, make_cache
    from mlxformer.generation.stream import decode_step, prefill

    cache = make_cache(model, CacheSettings()) if cache is None else cache
    steps = [np.array(prefill(model, mx.array(ids[:prefilled]), cache, step_size=step_size)[0])]
    for t in range(prefilled, len(ids)):
        steps.append(np.array(decode_step(model, mx.array(ids[t : t + 1]), cache)[0]))
    return np.stack(steps)


def assert_batch_and_speculation_match_alone(model: Any, tokenizer: Any, prompts: list[str] = PROMPTS,
                                            tokens: int = 12) -> list[Any]:
    """Greedy: ``batch_generate`` gives each prompt's text alone, and prompt-lookup speculation on
    the second prompt its tokens alone; returns the speculative responses."""
    from mlxformer import stream_generate
    from mlxformer.engine import batch_generate
    from mlxformer.speculative.speculator import SpeculativeSettings

    alone = [[r.token for r in stream_generate(model, tokenizer, p, tokens)] for p in prompts]
    assert batch_generate(model, tokenizer, prompts, tokens, max_batch=len(prompts)) == [tokenizer.decode(t) for t in alone]
    lookup = SpeculativeSettings(prompt_lookup=True, num_draft_tokens=4, ngram_min=1)
    responses = list(stream_generate(model, tokenizer, prompts[1], tokens, speculative=lookup))
    assert [r.token for r in responses] == alone[1]
    return responses
