"""Activation statistics for importance-weighted quantization.

The float model reads a short calibration text (written for this project, distinct from
any evaluation text); every linear layer records the mean square of each input column.
A weight column that multiplies large activations matters more to the layer's output, so
the quantizer weights its squared error by these values (a diagonal approximation of the
output error, as in llama.cpp's importance matrix).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from mlxformer.models.mask import causal_mask_for
from mlxformer.models.decoder import Model

CALIBRATION_TEXT = """\
Recipe notes for a rainy Sunday. Soak two cups of dried beans overnight, then simmer them with a bay leaf, \
half an onion and a generous pinch of salt until they are soft but not falling apart. Meanwhile, roast a \
tray of carrots and squash at 200 degrees Celsius for about forty minutes, turning them once.

User: Can you explain why the sky is blue?
Assistant: Sunlight contains every colour of visible light. When it passes through the atmosphere, the \
short blue wavelengths are scattered by gas molecules much more strongly than the long red ones, an \
effect called Rayleigh scattering. Wherever you look in the sky, some of that scattered blue light reaches \
your eyes, so the whole dome appears blue. At sunset the light travels through far more air, most of the \
blue is scattered away before it arrives, and the remaining light looks orange and red.

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]

The committee met on Tuesday to review the budget for the new library wing. After a long discussion, \
members agreed to postpone the purchase of furniture until the spring, when prices usually fall, and to \
spend the savings on extending the opening hours during the examination period. A short survey of students \
had shown that most of them preferred quiet study rooms to a larger café.

Question: A train leaves at 9:15 and arrives at 11:40. How long is the journey? Answer: two hours and \
twenty-five minutes. Question: What is 17 multiplied by 6? Answer: 102. Question: Which planet is closest \
to the Sun? Answer: Mercury.

In the old harbour town the fish market opens before dawn. Traders shout prices in three languages, gulls \
circle overhead, and by eight o'clock the stalls are hosed down and empty again, as if nothing had happened.
"""


class _Recorder(nn.Module):
    """Wraps a layer and passes its input to ``record``."""

    def __init__(self, inner: nn.Module, record: Callable[[mx.array], None]):
        super().__init__()
        self.inner = inner
        self._record = record

    def __call__(self, x: mx.array) -> mx.array:
        self._record(x)
        return self.inner(x)


def activation_importance(model: Model, token_ids: list[int], max_tokens: int = 128) -> dict[str, mx.array]:
    """Mean squared input activation per column, keyed by the layer path (``...q_proj``).

    For tied embeddings the statistics of the final norm's output (the input of the output
    projection) are stored under ``model.embed_tokens``. The output projection itself is not
    computed. ``model`` is modified (its linear layers wrapped) and should be discarded afterwards.
    """
    sums: dict[str, mx.array] = {}
    counts: dict[str, int] = {}

    def recorder_for(path: str) -> Callable[[mx.array], None]:
        def record(x: mx.array) -> None:
            flat = x.astype(mx.float32).reshape(-1, x.shape[-1])  # (tokens, in)
            total = mx.square(flat).sum(axis=0)
            sums[path] = sums[path] + total if path in sums else total
            counts[path] = counts.get(path, 0) + flat.shape[0]

        return record

    for layer_index, layer in enumerate(model.layers):
        prefix = f"model.layers.{layer_index}"
        for parent_name, parent in (("self_attn", layer.self_attn), ("mlp", layer.mlp)):
            for name, child in list(parent.children().items()):
                if isinstance(child, nn.Linear):
                    parent[name] = _Recorder(child, recorder_for(f"{prefix}.{parent_name}.{name}"))
    head = "model.embed_tokens" if model.args.tie_word_embeddings else "lm_head"
    tokens = mx.array(token_ids[:max_tokens])[None]  # (1, T)
    h = model.model.embed_tokens(tokens)
    mask = causal_mask_for(tokens.shape[1], tokens.shape[1], model.args.sliding_window)
    for layer in model.layers:
        h = layer(h, mask, None)
    recorder_for(head)(model.model.norm(h))  # the output projection's input; the projection itself is skipped
    mx.eval(sums)
    return {path: total / counts[path] for path, total in sums.items()}
