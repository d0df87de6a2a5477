"""Sliding-window perplexity of a model on a text file.

The standard (Hugging Face) strided evaluation: windows of ``context`` tokens start every
``stride`` tokens (but always overlap the previous one by a token, so ``stride == context``
skips nothing); each window scores only the tokens no earlier window scored, so every token
after the first is scored exactly once, with up to ``context - 1`` tokens of history.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlxformer.errors import MlxformerError
from mlxformer.sampling.samplers import logsumexp


def negative_log_likelihoods(logits: mx.array, targets: mx.array) -> mx.array:
    """``-log p(target)`` for each row of ``logits`` ``(T, vocab)`` and its ``targets`` ``(T,)``,
    in float32 (``sampling.logsumexp``: accurate to ~1e-6 on every device)."""
    logits = logits.astype(mx.float32)
    return logsumexp(logits)[:, 0] - mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]


def window_negative_log_likelihood(model: nn.Module, window: list[int], n_scored: int) -> float:
    """Sum of ``-log p(token | prefix)`` over the last ``n_scored`` tokens of ``window``."""
    tokens = mx.array(window)[None]  # (1, T)
    logits = model(tokens[:, :-1])[0]  # (T-1, vocab): predicts tokens[1:]
    return float(negative_log_likelihoods(logits[-n_scored:], tokens[0, -n_scored:]).sum().item())


def windows(n_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """The evaluation windows over ``n_tokens`` tokens: ``(start, end, n_scored)``, each scoring
    its last ``n_scored`` tokens. Windows start every ``stride`` tokens, but never after the
    token before the first unscored one (which needs history): so every token but the first
    is scored exactly once, also when ``stride == context``."""
    result: list[tuple[int, int, int]] = []
    start, scored_until = 0, 1  # tokens [1, scored_until) are scored
    while scored_until < n_tokens:
        end = min(start + context, n_tokens)
        result.append((start, end, end - scored_until))
        scored_until = end
        start = min(start + stride, end - 1)
    return result


def perplexity(model: nn.Module, token_ids: list[int], context: int = 256, stride: int = 128) -> float:
    """Sliding-window perplexity of ``token_ids``: windows of ``context`` tokens every ``stride``
    (``windows``). Token 0 is never scored (it has no history); every later token is scored once."""
    if context < 2 or not 1 <= stride <= context:
        raise MlxformerError("need --context >= 2 and 1 <= --stride <= --context")
    if len(token_ids) < 2:
        raise MlxformerError("the text has fewer than 2 tokens")
    total_nll, n_scored = 0.0, 0
    for start, end, new in windows(len(token_ids), context, stride):
        total_nll += window_negative_log_likelihood(model, token_ids[start:end], new)
        n_scored += new
    return math.exp(total_nll / n_scored)


def cached_perplexity(
    forward: Callable[[mx.array, Any], mx.array], cache: Sequence[Any], token_ids: list[int], chunk: int = 64
) -> float:
    """Perplexity of ``token_ids`` fed through one KV ``cache`` in ``chunk``-token pieces, as
    generation sees them: each token is scored with every earlier token cached (the way to
    measure what a quantized or rotating cache costs). ``forward(tokens (1, T), cache)`` returns
    logits ``(1, T, vocab)``; any runtime's model and cache fit."""
    if chunk < 1 or len(token_ids) < 2:
        raise MlxformerError("need chunk >= 1 and at least 2 tokens")
    total, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, chunk):
        piece = token_ids[start : start + chunk]
        targets = mx.array(token_ids[start + 1 : start + 1 + len(piece)])
        logits = forward(mx.array(piece)[None], cache)[0, : targets.size]  # (T, vocab)
        total += float(negative_log_likelihoods(logits, targets).sum())
        count += targets.size
    return math.exp(total / count)
