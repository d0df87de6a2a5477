"""Evaluating one step of a KV rewrite done one layer at a time (a cache growing, a row joining
or leaving a decode batch, the batch widening: under a KV budget, ``engine/memory.py``).

The rewrite frees the layer's old buffers, and MLX keeps freed buffers for reuse (its buffer
cache, resident memory). KV buffers are of sizes that seldom serve again, so kept they sit
beside the KV until the cache's limit is reached, and the next step's activations find no room
there (measured on SmolLM2-135M under a 112.5 MiB budget: the cache filled with them, issue 32,
``docs/design/scheduler-measurements.md``). So they are dropped as soon as the layer is rewritten.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def evaluate_rewrite(*arrays: Any) -> None:
    """Evaluate a rewritten layer's new buffers (``mx.eval``'s arguments) and free the old ones
    at once rather than keep them in MLX's buffer cache."""
    mx.eval(*arrays)
    mx.clear_cache()
