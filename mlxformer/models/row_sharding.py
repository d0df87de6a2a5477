"""Projections split by output rows and run on several CPU streams at once.

MLX's CPU backend runs each matmul on one thread, so a decode step uses one core while the
projections are ~80% of its time. Each stream has its own worker thread: splitting every
projection's rows into ``threads`` shards (views of the same buffers: no extra memory) and
evaluating the shards on separate streams uses every core. On a GPU there is one device to
feed, so this is a CPU-only policy.
"""

from __future__ import annotations

import copy
from functools import lru_cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxformer.device import available_cores, on_cpu
from mlxformer.errors import MlxformerError
from mlxformer.models.decoder import MLP, Model, swiglu

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_DEFAULT_THREADS = 4
# Measured on SmolLM2 float32, 2 streams: a 55/45 split decodes 4-5% faster than 50/50.
LEAD_SHARE = 1.2
_STREAMS: list[mx.Stream] = []


def default_threads() -> int:
    """Streams to split projections over: the usable cores (at most 4) on the CPU device, else 1."""
    return min(available_cores(), MAX_DEFAULT_THREADS) if on_cpu() else 1


def worker_streams(count: int) -> list[mx.Stream]:
    """The default stream and ``count - 1`` more CPU streams, created once per process."""
    while len(_STREAMS) < count - 1:
        _STREAMS.append(mx.new_stream(mx.cpu))
    return [mx.default_stream(mx.cpu), *_STREAMS[: count - 1]]


class RowSharded:
    """Mixin for a layer whose output rows are computed in ``parts`` slices, each on its own
    CPU stream, then concatenated. The layer holds its arrays exactly as the plain layer does
    (same parameter names, ``isinstance`` checks unchanged); the row slices are views of its
    *current* arrays taken at every call, so ``set_dtype``, ``load_weights`` and
    ``nn.quantize`` (which returns the sharded quantized class) keep the sharding intact."""

    parts: int

    def project_rows(self, x: mx.array) -> mx.array:
        """``x @ W^T`` (plus any bias), row slices of W computed on separate streams."""
        bounds = row_bounds(self["weight"].shape[0], self.parts)
        streams = worker_streams(len(bounds))
        return mx.concatenate([self.project_slice(x, a, b, s) for (a, b), s in zip(bounds, streams)], axis=-1)

    def project_slice(self, x: mx.array, start: int, stop: int, stream: mx.Stream) -> mx.array:
        """Output columns ``start:stop`` computed on ``stream``."""
        raise NotImplementedError


class DenseRows(RowSharded):
    """Row slices of a dense ``weight`` (and optional ``bias``)."""

    def project_slice(self, x: mx.array, start: int, stop: int, stream: mx.Stream) -> mx.array:
        with mx.stream(stream):  # the views are made on the stream that uses them
            weight_t = self["weight"][start:stop].T  # a view: no copy
            if "bias" in self:
                return mx.addmm(self["bias"][start:stop], x, weight_t)
            return mx.matmul(x, weight_t)


class QuantizedRows(RowSharded):
    """Row slices of a packed ``weight`` with its ``scales``/``biases`` (and optional ``bias``)."""

    group_size: int
    bits: int
    mode: str

    def project_slice(self, x: mx.array, start: int, stop: int, stream: mx.Stream) -> mx.array:
        with mx.stream(stream):
            biases = self.get("biases")
            out = mx.quantized_matmul(
                x, self["weight"][start:stop], scales=self["scales"][start:stop],
                biases=None if biases is None else biases[start:stop], transpose=True,
                group_size=self.group_size, bits=self.bits, mode=self.mode,
            )
            return out + self["bias"][start:stop] if "bias" in self else out


class ShardedLinear(DenseRows, nn.Linear):
    """``nn.Linear`` computed in row shards on several streams."""

    def __call__(self, x: mx.array) -> mx.array:
        return self.project_rows(x)

    def to_quantized(self, *args: Any, **kwargs: Any) -> nn.Module:
        return shard_rows(super().to_quantized(*args, **kwargs), self.parts)


class ShardedQuantizedLinear(QuantizedRows, nn.QuantizedLinear):
    """``nn.QuantizedLinear`` computed in row shards on several streams."""

    def __call__(self, x: mx.array) -> mx.array:
        return self.project_rows(x)


class ShardedEmbedding(DenseRows, nn.Embedding):
    """``nn.Embedding`` whose ``as_linear`` (the tied vocabulary projection) is row-sharded."""

    def as_linear(self, x: mx.array) -> mx.array:
        return self.project_rows(x)

    def to_quantized(self, *args: Any, **kwargs: Any) -> nn.Module:
        return shard_rows(super().to_quantized(*args, **kwargs), self.parts)


class ShardedQuantizedEmbedding(QuantizedRows, nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose ``as_linear`` is row-sharded."""

    def as_linear(self, x: mx.array) -> mx.array:
        return self.project_rows(x)


SHARDED_CLASS: dict[type, type] = {
    nn.Linear: ShardedLinear,
    nn.QuantizedLinear: ShardedQuantizedLinear,
    nn.Embedding: ShardedEmbedding,
    nn.QuantizedEmbedding: ShardedQuantizedEmbedding,
}


class ShardedMLP(MLP):
    """The SwiGLU MLP with ``swiglu(gate, up)`` computed shard by shard on each stream, so
    the gate and up outputs are never concatenated: one join, before ``down_proj``."""

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = self.gate_proj, self.up_proj
        if not (isinstance(gate, RowSharded) and isinstance(up, RowSharded)):
            return super().__call__(x)  # a layer type that has no sharded class
        bounds = row_bounds(gate["weight"].shape[0], gate.parts)
        hidden = []
        for (start, stop), stream in zip(bounds, worker_streams(len(bounds))):
            with mx.stream(stream):
                hidden.append(swiglu(gate.project_slice(x, start, stop, stream), up.project_slice(x, start, stop, stream)))
        return self.down_proj(mx.concatenate(hidden, axis=-1))


@lru_cache(maxsize=None)
def row_bounds(rows: int, parts: int, align: int = 8) -> tuple[tuple[int, int], ...]:
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
    return tuple((start, stop) for start, stop in zip(cuts, cuts[1:]) if stop > start)


def shard_rows(layer: nn.Module, parts: int) -> nn.Module:
    """``layer`` (a linear, quantized linear, embedding or quantized embedding) as its
    row-sharded class: a shallow copy holding the same arrays, computing its output rows in
    ``parts`` slices on separate streams. Other layer types are returned unchanged."""
    sharded_class = SHARDED_CLASS.get(type(layer))
    if sharded_class is None:
        return layer
    sharded = copy.copy(layer)
    sharded.__class__ = sharded_class
    sharded.parts = parts
    return sharded


def shard_mlp(mlp: MLP) -> ShardedMLP:
    """``mlp`` as a ``ShardedMLP`` holding the same sub-layers."""
    sharded = copy.copy(mlp)
    sharded.__class__ = ShardedMLP
    return sharded


def apply_thread_policy(model: Model, threads: int | None) -> None:
    """Split every projection and the vocabulary projection over ``threads`` CPU streams
    (``None``: ``default_threads()``; 1 leaves the model as it is). The sharded layers are
    part of the model tree (their classes show in ``named_modules()``), and the row slices
    are taken from their current arrays at every call: weights may be cast, reloaded or
    quantized afterwards."""
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
                if name in owner:
                    owner[name] = shard_rows(owner[name], threads)
        layer.mlp = shard_mlp(layer.mlp)
    if model.args.tie_word_embeddings:
        model.model.embed_tokens = shard_rows(model.model.embed_tokens, threads)
    else:
        model.lm_head = shard_rows(model.lm_head, threads)
