"""The two forward passes generation is made of: chunked ``prefill`` of a prompt and
``decode_step`` of one token, both over a KV cache."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from mlxformer.cache.protocol import Cache
from mlxformer.errors import MlxformerError
from mlxformer.models.decoder import Model
from mlxformer.models.device_plan import DevicePlan

def default_prefill_step() -> int:
    """Prefill chunk size for the default device (``DevicePlan.prefill_step``)."""
    return DevicePlan.current().prefill_step


def prefill(model: Model, tokens: mx.array, cache: Sequence[Cache], step_size: int | None = None) -> mx.array:
    """Run ``tokens`` (T,) through the model in chunks of ``step_size`` (default:
    ``default_prefill_step()``); return the last logits (1, vocab)."""
    step_size = step_size or default_prefill_step()
    if tokens.size == 0:
        raise MlxformerError("empty prompt: nothing to generate from")
    # Every chunk's RoPE sees the whole prompt's length (dynamic NTK scaling depends on it).
    offset = cache[0].offset if cache else 0
    length = (offset if isinstance(offset, int) else int(offset.max())) + tokens.size
    while tokens.size > step_size:
        model.hidden_states(tokens[None, :step_size], cache, rope_length=length)
        mx.eval([c.state for c in cache])
        tokens = tokens[step_size:]
    return model.last_logits(tokens[None], cache, rope_length=length)


def decode_step(model: Model, token: mx.array, cache: Sequence[Cache]) -> mx.array:
    """One token (1,) in, next-token logits (1, vocab) out."""
    return model.last_logits(token[None], cache)
