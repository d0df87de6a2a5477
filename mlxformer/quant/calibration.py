"""Activation statistics for importance-weighted quantization.

The float model reads a short calibration text (written for this project, distinct from
any evaluation text); every linear layer records the mean square of each input column.
The decoder's own forward runs with one stage's weights loaded at a time (the embedding, each
decoder layer, the final norm), each with only its own float32 parameters in memory, so
calibrating needs about one layer in float32 rather than a float32 copy of the whole model.
A weight column that multiplies large activations matters more to the layer's output, so
the quantizer weights its squared error by these values (a diagonal approximation of the
output error, as in llama.cpp's importance matrix).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from mlxformer.models.config import ModelArgs
from mlxformer.models.decoder import Model

# The float32 parameters of the module at a path (``model.layers.3``), named relative to it
# (``self_attn.q_proj.weight``); called once per stage, just before the stage runs.
ParamsOf = Callable[[str], dict[str, mx.array]]
# The stack's modules that turn token ids into the first layer's input (``Model.embed``), those
# the model has: the embedding, GPT-2's positions, Gemma 4's per-layer inputs.
_INPUT_MODULES = ("embed_tokens", "embed_positions", "embed_tokens_per_layer", "per_layer_model_projection",
                  "per_layer_projection_norm")

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


class _Statistics:
    """Running sums of squared inputs per column, and token counts, per layer path."""

    def __init__(self) -> None:
        self.sums: dict[str, mx.array] = {}
        self.counts: dict[str, int] = {}

    def recorder_for(self, path: str) -> Callable[[mx.array], None]:
        def record(x: mx.array) -> None:
            flat = x.astype(mx.float32).reshape(-1, x.shape[-1])  # (tokens, in)
            total = mx.square(flat).sum(axis=0)
            self.sums[path] = self.sums[path] + total if path in self.sums else total
            self.counts[path] = self.counts.get(path, 0) + flat.shape[0]

        return record

    def means(self) -> dict[str, mx.array]:
        return {path: total / self.counts[path] for path, total in self.sums.items()}


def _record_linear_inputs(layer: nn.Module, prefix: str, stats: _Statistics) -> None:
    for parent_name in (layer.mixer_name, layer.mlp_name):  # a MoE block: its router (routed experts go unweighted)
        parent = layer[parent_name]
        for name, child in list(parent.children().items()):
            if isinstance(child, nn.Linear):
                parent[name] = _Recorder(child, stats.recorder_for(f"{prefix}.{parent_name}.{name}"))


def activation_importance(
    args: ModelArgs, params_of: ParamsOf, token_ids: list[int], max_tokens: int = 128
) -> dict[str, mx.array]:
    """Mean squared input activation per column, keyed by the layer path (``...q_proj``).

    The decoder runs (its own ``embed`` and ``run_layers``) on the first ``max_tokens`` ids
    stage by stage: each stage's float32 parameters come from ``params_of(path)``, are loaded
    just before the stage runs and released after, so peak memory is about one decoder layer
    in float32 (the embedding matrices too while the ids are embedded). For tied embeddings
    the statistics of the final norm's output (the input of the output projection) are stored
    under ``model.embed_tokens``; the output projection itself is not computed.
    """
    model = Model(args)  # its parameters stay lazy, never evaluated: each stage gets real ones in turn
    stats = _Statistics()
    tokens = mx.array(token_ids[:max_tokens])[None]  # (1, T)
    stack, layers = model.model, model.layers
    inputs = [name for name in _INPUT_MODULES if name in stack]  # the embedding (GPT-2: positions; Gemma 4: per layer)
    for name in inputs:
        stack[name].load_weights(list(params_of(f"model.{name}").items()), strict=True)
    h, extra = model.embed(tokens)  # (1, T, hidden), Gemma 4's (1, T, layers, size) or None
    mx.eval([a for a in (h, extra) if a is not None])
    for name in inputs:  # the stage is done: free its float32 matrices
        del stack[name]

    def before_layer(index: int, h: mx.array) -> None:
        mx.eval(h, stats.sums)  # the previous layer's output: its parameters may go
        if index:
            layers[index - 1] = None  # the decoder's list held the only other reference
        prefix = f"model.layers.{index}"
        params = params_of(prefix)
        for value in params.values():  # one at a time: each source tensor is freed before the next is read
            mx.eval(value)
        layers[index].load_weights(list(params.items()), strict=True)
        _record_linear_inputs(layers[index], prefix, stats)

    h = model.run_layers(h, per_layer_inputs=extra, before_layer=before_layer)
    mx.eval(h, stats.sums)
    layers[-1] = None
    norm = stack.norm
    norm.load_weights(list(params_of("model.norm").items()), strict=True)
    head = "model.embed_tokens" if args.tie_word_embeddings else "lm_head"
    stats.recorder_for(head)(norm(h))  # the output projection's input; the projection itself is skipped
    mx.eval(stats.sums)
    return stats.means()
