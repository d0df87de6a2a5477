"""Projections split by output rows and run on several CPU streams at once.

MLX's CPU backend runs each matmul on one thread, so a decode step uses one core while the
projections are ~80% of its time. Each stream has its own worker thread: splitting every
projection's rows into ``threads`` shards (views of the same buffers: no extra memory) and
evaluating the shards on separate streams uses every core. On a GPU there is one device to
feed, so this is a CPU-only policy.
"""

from __future__ import annotations

import copy
import threading

import mlx.core as mx
import mlx.nn as nn

from mlxformer.device import available_cores, on_cpu
from mlxformer.errors import MlxformerError
from mlxformer.models.decoder import MLP, Model, swiglu

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_DEFAULT_THREADS = 4
# Measured on SmolLM2 float32, 2 streams: a 55/45 split decodes 4-5% faster than 50/50.
LEAD_SHARE = 1.2
# MLX streams belong to the thread that made them: each thread running the model (the caller,
# a batching engine's loop) gets its own worker streams.
_STREAMS = threading.local()


def default_threads() -> int:
    """Streams to split projections over: the usable cores (at most 4) on the CPU device, else 1."""
    return min(available_cores(), MAX_DEFAULT_THREADS) if on_cpu() else 1


def worker_streams(count: int) -> list[mx.Stream]:
    """The default stream and ``count - 1`` more CPU streams, created once per thread."""
    streams: list[mx.Stream] = _STREAMS.__dict__.setdefault("streams", [])
    while len(streams) < count - 1:
        streams.append(mx.new_stream(mx.cpu))
    return [mx.default_stream(mx.cpu), *streams[: count - 1]]


class RowSharded:
    """Mixin for a linear layer whose output rows are computed in slices, each on its own
    CPU stream, then concatenated. The layer keeps its own arrays (so parameter names and
    ``isinstance`` checks are unchanged); the slices are views of them under a private name
    that ``parameters()`` skips."""

    _shards: list[dict[str, mx.array]]

    def __call__(self, x: mx.array) -> mx.array:
        streams = worker_streams(len(self._shards))
        return mx.concatenate([self._project(x, shard, s) for shard, s in zip(self._shards, streams)], axis=-1)

    def _project(self, x: mx.array, shard: dict[str, mx.array], stream: mx.Stream) -> mx.array:
        raise NotImplementedError


class ShardedLinear(RowSharded, nn.Linear):
    """``nn.Linear`` computed in row shards on several streams."""

    def _project(self, x: mx.array, shard: dict[str, mx.array], stream: mx.Stream) -> mx.array:
        if "bias" in shard:
            return mx.addmm(shard["bias"], x, shard["weight_t"], stream=stream)
        return mx.matmul(x, shard["weight_t"], stream=stream)


class ShardedQuantizedLinear(RowSharded, nn.QuantizedLinear):
    """``nn.QuantizedLinear`` computed in row shards on several streams."""

    def _project(self, x: mx.array, shard: dict[str, mx.array], stream: mx.Stream) -> mx.array:
        out = mx.quantized_matmul(
            x, shard["weight"], scales=shard["scales"], biases=shard.get("biases"), transpose=True,
            group_size=self.group_size, bits=self.bits, mode=self.mode, stream=stream,
        )
        return mx.add(out, shard["bias"], stream=stream) if "bias" in shard else out


SHARDED_CLASS = {nn.Linear: ShardedLinear, nn.QuantizedLinear: ShardedQuantizedLinear}


class ShardedMLP(MLP):
    """The SwiGLU MLP with ``swiglu(gate, up)`` computed shard by shard on each stream, so
    the gate and up outputs are never concatenated: one join, before ``down_proj``."""

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = self.gate_proj, self.up_proj
        hidden = []
        for gate_shard, up_shard, stream in zip(gate._shards, up._shards, worker_streams(len(gate._shards))):
            with mx.stream(stream):
                hidden.append(swiglu(gate._project(x, gate_shard, stream), up._project(x, up_shard, stream)))
        return self.down_proj(mx.concatenate(hidden, axis=-1))


def row_bounds(rows: int, parts: int, align: int = 8) -> list[tuple[int, int]]:
    """``[start, stop)`` row ranges for ``parts`` shards, cut at multiples of ``align`` where
    possible. The first shard, run by the calling stream, is ``LEAD_SHARE`` times the others:
    the other streams start a thread wake-up later."""
    weights = [LEAD_SHARE] + [1.0] * (parts - 1)
    unit = align if rows >= parts * align else 1
    cuts = [0]
    for i in range(1, parts):
        cut = round(rows * sum(weights[:i]) / sum(weights) / unit) * unit
        cuts.append(min(max(cut, cuts[-1]), rows))
    cuts.append(rows)
    return [(start, stop) for start, stop in zip(cuts, cuts[1:]) if stop > start]


def own_arrays(module: nn.Module) -> dict[str, mx.array]:
    """The arrays a layer holds directly (weight, bias, scales, biases)."""
    return {name: value for name, value in module.items() if isinstance(value, mx.array)}


def shard_rows(layer: nn.Linear | nn.QuantizedLinear, parts: int) -> nn.Module:
    """A copy of ``layer`` that computes its output rows in ``parts`` shards on separate
    streams. The shards are views of the layer's arrays (a dense weight's view is transposed
    once here rather than on every call)."""
    arrays = own_arrays(layer)
    shards = []
    for start, stop in row_bounds(arrays["weight"].shape[0], parts):
        shard = {name: value[start:stop] for name, value in arrays.items()}
        if not isinstance(layer, nn.QuantizedLinear):
            shard["weight_t"] = shard.pop("weight").T
        shards.append(shard)
    sharded = copy.copy(layer)
    sharded.__class__ = SHARDED_CLASS[type(layer)]
    sharded._shards = shards
    return sharded


def output_layer(model: Model) -> nn.Module:
    """The vocabulary projection as a linear layer (a tied embedding is re-wrapped)."""
    if not model.args.tie_word_embeddings:
        return model.lm_head
    embedding = model.model.embed_tokens
    arrays = own_arrays(embedding)
    if isinstance(embedding, nn.QuantizedEmbedding):
        mode = getattr(embedding, "mode", "affine")
        head = nn.QuantizedLinear(
            embedding.group_size, 1, bias=False, group_size=embedding.group_size, bits=embedding.bits, mode=mode
        )
        head.update(arrays)
        return head
    head = nn.Linear(1, 1, bias=False)
    head.update(arrays)
    return head


def apply_thread_policy(model: Model, threads: int | None) -> None:
    """Split every projection and the vocabulary projection over ``threads`` CPU streams
    (``None``: ``default_threads()``; 1 leaves the model as it is). The shards are views
    of the loaded weights: load or update weights before, not after."""
    threads = default_threads() if threads is None else threads
    if threads < 1:
        raise MlxformerError(f"threads must be at least 1, got {threads}")
    if threads == 1:
        return
    if not on_cpu():
        raise MlxformerError(f"threads > 1 splits work over CPU streams, but the default device is {mx.default_device()}")
    for layer in model.layers:
        for owner in (layer.self_attn, layer.mlp):
            for name in PROJECTIONS:
                if name in owner and not isinstance(owner[name], RowSharded):
                    owner[name] = shard_rows(owner[name], threads)
        layer.mlp.__class__ = ShardedMLP
    model.use_output_projection(shard_rows(output_layer(model), threads))
