"""Runs the one decoder over a batch of sequences, each with its own per-layer caches.

A decode step feeds one token per sequence as a ``(B, 1)`` batch: the projections and the MLP
(the weight reads that dominate decoding) run once for all sequences, each row is rotated at
its own position (``mx.fast.rope`` with an offsets array), and each sequence attends over its
own cache, so ragged lengths, float/quantized and rotating caches all work unchanged.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from mlxformer.cache import Cache
from mlxformer.models.decoder import Model
from mlxformer.models.mask import Mask


class BatchedLayerCache:
    """One layer's view over B sequences' caches, implementing the cache protocol for ``(B, L)`` input.

    Each row is stored in, and attends over, its own cache with that cache's own mask, exactly as
    when the sequence runs alone. ``make_mask`` returns None: the masks are per row and are taken
    from each row's cache before it is updated.
    """

    def __init__(self, caches: Sequence[Cache], window: int | None) -> None:
        self.caches = list(caches)
        self.window = window
        self.offset = mx.array([c.offset for c in self.caches])  # (B,)
        self._masks: list[Mask] = []

    def make_mask(self, query_len: int, window: int | None) -> Mask:
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[list[Any], list[Any]]:
        query_len = keys.shape[2]
        self._masks = [c.make_mask(query_len, self.window) for c in self.caches]
        fetched = [c.update_and_fetch(keys[i : i + 1], values[i : i + 1]) for i, c in enumerate(self.caches)]
        return [k for k, _ in fetched], [v for _, v in fetched]

    def attention(
        self, queries: mx.array, keys: Any, values: Any, scale: float, mask: Mask, softcap: float | None = None
    ) -> mx.array:
        rows = [
            c.attention(queries[i : i + 1], keys[i], values[i], scale, self._masks[i], softcap)
            for i, c in enumerate(self.caches)
        ]
        return mx.concatenate(rows, axis=0)  # (B, n_heads, L, head_dim)

    @property
    def state(self) -> tuple[mx.array, ...]:
        return tuple(a for c in self.caches for a in c.state)

    @property
    def meta_state(self) -> dict[str, str]:
        return {}

    def trim(self, n: int) -> int:
        return min(c.trim(n) for c in self.caches)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)


class BatchRunner:
    """Turns the scheduled work into decoder calls: prompt chunks and batched decode steps."""

    def __init__(self, model: Model) -> None:
        self.model = model

    def prefill(self, tokens: Sequence[int], cache: Sequence[Cache], want_logits: bool) -> mx.array | None:
        """Run one prompt chunk through one sequence's caches; the last position's logits
        ``(1, vocab)`` when ``want_logits`` (lazy), else None (the cache is evaluated)."""
        inputs = mx.array(tokens)[None]  # (1, T)
        if want_logits:
            return self.model.last_logits(inputs, cache)
        self.model.hidden_states(inputs, cache)
        mx.eval([c.state for c in cache])
        return None

    def verify(self, tokens: Sequence[int], cache: Sequence[Cache]) -> mx.array:
        """A speculation round on one sequence's caches: the last token then the proposals in,
        every position's logits ``(T, vocab)`` out (lazy)."""
        return self.model(mx.array(tokens)[None], cache)[0]  # (1, T, vocab) -> (T, vocab)

    def decode(self, tokens: Sequence[int], caches: Sequence[Sequence[Cache]]) -> mx.array:
        """One token per sequence in, next-token logits ``(B, vocab)`` out (lazy)."""
        inputs = mx.array(tokens)[:, None]  # (B, 1)
        if len(caches) == 1:  # alone: exactly the single-stream path
            return self.model.last_logits(inputs, caches[0])
        layers = [BatchedLayerCache(layer_caches, layer.window) for layer, layer_caches in zip(self.model.layers, zip(*caches))]
        return self.model.last_logits(inputs, layers)
