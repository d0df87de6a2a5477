"""``batch_generate``: a list of prompts completed in one continuous batch on a short-lived engine."""

from __future__ import annotations

from typing import Any, Sequence as Seq

from mlxformer.cache import CacheSettings
from mlxformer.engine.engine import Engine
from mlxformer.engine.request_state import GenerationRequest
from mlxformer.errors import MlxformerError
from mlxformer.sampling.options import SamplingSettings, sampling_with
from mlxformer.models.decoder import Model
from mlxformer.speculative.speculator import SpeculativeSettings
from mlxformer.text.tokenizer import Tokenizer


def batch_generate(
    model: Model,
    tokenizer: Tokenizer,
    prompts: Seq[str | Seq[int]],
    max_tokens: int = 256,
    *,
    sampling: SamplingSettings = SamplingSettings(),
    stop: Seq[str] = (),
    cache_settings: CacheSettings | None = None,
    max_batch: int = 8,
    prefill_chunk: int | None = None,
    prefix_cache_bytes: int = 512 * 2**20,
    speculative: SpeculativeSettings | None = None,
    **sampling_kwargs: Any,
) -> list[str]:
    """Complete every prompt (raw text or token ids, no chat template) in one continuous batch;
    returns the completions in order. Sampling may be given as ``sampling=`` or as keywords
    (``temp``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``seed``);
    ``speculative`` decodes each sequence speculatively (same greedy output)."""
    if isinstance(prompts, str):
        raise MlxformerError("prompts must be a list of prompts (texts or token-id lists), not one string")
    if sampling_kwargs:
        sampling = sampling_with(sampling, sampling_kwargs)
    engine = Engine(
        model, tokenizer, max_batch=max_batch, max_queue=max(len(prompts), 1), cache_settings=cache_settings,
        prefix_cache_bytes=prefix_cache_bytes, prefill_chunk=prefill_chunk, speculative=speculative,
    )
    requests = [
        GenerationRequest(tokenizer.encode(p) if isinstance(p, str) else list(p), max_tokens, sampling, stop)
        for p in prompts
    ]
    with engine:
        handles = [engine.submit(r) for r in requests]
        return ["".join(event.text for event in handle) for handle in handles]
