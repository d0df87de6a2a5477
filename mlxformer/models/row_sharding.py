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
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxformer.device import on_cpu
from mlxformer.errors import MlxformerError
from mlxformer.models.decoder import Model
from mlxformer.models.device_plan import DevicePlan
from mlxformer.models.mlp import GATES, MLP
from mlxformer.adapters.layers import Adapted
from mlxformer.models.expert_counts import ExpertBounds, counting_pays, expert_bounds
from mlxformer.models.moe import QuantizedSwitchLinear, SwitchGLU, SwitchLinear
from mlxformer.sampling.options import check_integer

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj",
               "in_proj_qkv", "in_proj_z", "in_proj_qkvz", "out_proj")  # the last four: Gated DeltaNet's
# From this many input rows (a prompt chunk, a verification pass) a shard computes
# ``(W @ x^T)^T`` instead of ``x @ W^T``: the BLAS MLX's CPU build links (the reference one)
# runs that layout 2.5-4x faster (measured, 8192x2048 float32: 32 rows 2680 -> 670 ms, 128
# rows 5140 -> 1740 ms; 2 rows no gain). A quantized shard is dequantized for it: MLX's CPU
# ``quantized_matmul`` costs a matrix-vector product per row (25 ms a row for 4096x2048), the
# dequantize ~140 ms once.
WIDE_ROWS = 8
# Measured on SmolLM2 float32, 2 streams: a 55/45 split decodes 4-5% faster than 50/50.
LEAD_SHARE = 1.2
# MLX streams belong to the thread that made them: each thread running the model (the caller,
# a batching engine's loop) gets its own worker streams.
_STREAMS = threading.local()


def default_threads() -> int:
    """Streams to split projections over on the default device (``DevicePlan.threads``)."""
    return DevicePlan.current().threads


def worker_streams(count: int) -> list[mx.Stream]:
    """The default stream and ``count - 1`` more CPU streams, created once per thread."""
    streams: list[mx.Stream] = _STREAMS.__dict__.setdefault("streams", [])
    while len(streams) < count - 1:
        streams.append(mx.new_stream(mx.cpu))
    return [mx.default_stream(mx.cpu), *streams[: count - 1]]


@dataclass(frozen=True)
class RowViews:
    """Row-slice views of a layer's arrays, one dict per shard, valid while the layer still
    holds exactly the arrays in ``sources``."""

    sources: tuple[mx.array, ...]
    shards: tuple[dict[str, mx.array], ...]


class RowSharded:
    """Mixin for a layer whose output rows are computed in ``parts`` slices, each on its own
    CPU stream, then concatenated. The layer holds its arrays exactly as the plain layer does
    (same parameter names, ``isinstance`` checks unchanged). The slices are views of those
    arrays (no copies), rebuilt whenever the layer holds different arrays than when they were
    made, so ``set_dtype``, ``load_weights``, ``update`` and ``nn.quantize`` (which returns
    the sharded quantized class) keep the sharding intact and current. (Views are kept
    between calls: building them at every call costs a decode step ~10-20% on a busy CPU.)"""

    parts: int
    row_axis = 0  # the axis of the output rows in every array the layer holds
    _row_views: RowViews | None = None

    def row_shards(self) -> tuple[dict[str, mx.array], ...]:
        """Per shard, views of this layer's current arrays restricted to the shard's rows."""
        arrays = {name: value for name, value in self.items() if isinstance(value, mx.array)}
        sources = tuple(arrays.values())
        views = self._row_views
        if views is None or len(views.sources) != len(sources) or any(a is not b for a, b in zip(views.sources, sources)):
            rows = arrays["weight"].shape[self.row_axis]
            shards = tuple(self.slice_rows(arrays, start, stop) for start, stop in row_bounds(rows, self.parts))
            views = self._row_views = RowViews(sources, shards)
        return views.shards

    def slice_rows(self, arrays: dict[str, mx.array], start: int, stop: int) -> dict[str, mx.array]:
        """Views of ``arrays`` for output rows ``start:stop``."""
        if self.row_axis == 1:
            return {name: value[:, start:stop] for name, value in arrays.items()}
        return {name: value[start:stop] for name, value in arrays.items()}

    def project_rows(self, x: mx.array) -> mx.array:
        """``x @ W^T`` (plus any bias), the row shards computed on separate streams."""
        shards = self.row_shards()
        streams = worker_streams(len(shards))
        return mx.concatenate([self.project_shard(x, shard, s) for shard, s in zip(shards, streams)], axis=-1)

    def project_shard(self, x: mx.array, shard: dict[str, mx.array], stream: mx.Stream) -> mx.array:
        """One shard's output columns, computed on ``stream``."""
        raise NotImplementedError


def rows_of(x: mx.array) -> int:
    """Input rows of a projection: every axis of ``x`` but the last."""
    return x.size // x.shape[-1]


def wide_project(x: mx.array, weight: mx.array, bias: mx.array | None, stream: mx.Stream) -> mx.array:
    """``x @ weight^T (+ bias)`` for ``x (..., in)``, ``weight (out, in)``, computed as
    ``(weight @ x^T)^T`` (see ``WIDE_ROWS``)."""
    flat_t = mx.contiguous(x.reshape(-1, x.shape[-1]).T, stream=stream)  # (..., in) -> (in, rows)
    out = mx.matmul(weight, flat_t, stream=stream).T.reshape(*x.shape[:-1], weight.shape[0])  # (out, rows) -> (..., out)
    return out if bias is None else mx.add(out, bias, stream=stream)


def dense_project(x: mx.array, weight: mx.array, bias: mx.array | None, stream: mx.Stream) -> mx.array:
    """``x @ weight^T (+ bias)``, ``weight (out, in)``, in the layout for ``x``'s row count."""
    if rows_of(x) >= WIDE_ROWS:
        return wide_project(x, weight, bias, stream)
    if bias is not None:
        return mx.addmm(bias, x, weight.T, stream=stream)
    return mx.matmul(x, weight.T, stream=stream)


def quantized_project(x: mx.array, arrays: dict[str, mx.array], group_size: int, bits: int, mode: str,
                      stream: mx.Stream) -> mx.array:
    """``x`` through packed ``arrays`` (weight, scales, optional biases and bias): the quantized
    product for a few rows, the dequantized weight in the wide layout for many."""
    if rows_of(x) >= WIDE_ROWS:
        # scales and biases in ``x``'s dtype first: MLX dequantizes in the scales' dtype, and a
        # float16 ``s * q + b`` is off by ~1e-3 of quantized_matmul's float32 sum
        # (affine only: the microscaling modes' scales are integer exponents)
        scales, biases = arrays["scales"], arrays.get("biases")
        if mode == "affine":
            scales, biases = (None if a is None else a.astype(x.dtype, stream=stream) for a in (scales, biases))
        weight = mx.dequantize(arrays["weight"], scales, biases, group_size=group_size, bits=bits, mode=mode,
                               dtype=x.dtype, stream=stream)
        return wide_project(x, weight, arrays.get("bias"), stream)
    out = mx.quantized_matmul(x, arrays["weight"], scales=arrays["scales"], biases=arrays.get("biases"), transpose=True,
                              group_size=group_size, bits=bits, mode=mode, stream=stream)
    return mx.add(out, arrays["bias"], stream=stream) if "bias" in arrays else out


class DenseRows(RowSharded):
    """Row shards of a dense ``weight`` (and optional ``bias``)."""

    def project_shard(self, x: mx.array, shard: dict[str, mx.array], stream: mx.Stream) -> mx.array:
        return dense_project(x, shard["weight"], shard.get("bias"), stream)


class QuantizedRows(RowSharded):
    """Row shards of a packed ``weight`` with its ``scales``/``biases`` (and optional ``bias``)."""

    group_size: int
    bits: int
    mode: str

    def project_shard(self, x: mx.array, shard: dict[str, mx.array], stream: mx.Stream) -> mx.array:
        return quantized_project(x, shard, self.group_size, self.bits, self.mode, stream)


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


class SwitchRows(RowSharded):
    """Row shards of stacked experts (``(experts, out, in)`` arrays: rows on axis 1). A decode
    step's few unsorted pairs gather on one stream (the layer's own ``gather``), where two
    cost more than they share; expert-sorted pairs gather in row shards, one per stream.

    ``project_counted`` projects sorted pairs expert by expert instead: MLX's CPU
    ``gather_mm``/``gather_qmm`` do a matrix-vector product per pair, while each expert's
    contiguous rows make one matrix product (``project_expert``, in the ``WIDE_ROWS`` layout):
    1.6-1.8x faster for 64-128 tokens over 8-64 experts. It needs each expert's row count on
    the host, read once per block by ``ShardedSwitchGLU``."""

    row_axis = 1

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        """``x (pairs, 1, in)`` and ``indices (pairs,)`` -> ``(pairs, 1, out)`` (unsorted:
        the gather's broadcast shapes)."""
        if not sorted_indices:
            return self.gather(x, indices, False, self)  # type: ignore[attr-defined]
        shards = self.row_shards()
        return mx.concatenate([self.gather(x, indices, True, shard, stream)  # type: ignore[attr-defined]
                               for shard, stream in zip(shards, worker_streams(len(shards)))], axis=-1)

    def project_counted(self, rows: mx.array, bounds: ExpertBounds) -> mx.array:
        """Expert-sorted ``rows (pairs, in)`` -> ``(pairs, out)``, each expert's rows
        ``bounds`` (``expert_counts.expert_bounds``) in one product per shard."""
        shards = self.row_shards()
        return mx.concatenate([
            mx.concatenate([self.project_expert(rows[start:stop], shard, e, stream) for e, start, stop in bounds], axis=0)
            for shard, stream in zip(shards, worker_streams(len(shards)))], axis=-1)

    def project_expert(self, x: mx.array, shard: dict[str, mx.array], expert: int, stream: mx.Stream) -> mx.array:
        """Rows ``x (n, in)`` through expert ``expert`` of ``shard`` -> ``(n, shard rows)``."""
        raise NotImplementedError


class ShardedSwitchLinear(SwitchRows, SwitchLinear):
    """``SwitchLinear`` in row shards."""

    def project_expert(self, x: mx.array, shard: dict[str, mx.array], expert: int, stream: mx.Stream) -> mx.array:
        bias = shard["bias"][expert] if "bias" in shard else None
        return dense_project(x, shard["weight"][expert], bias, stream)

    def to_quantized(self, *args: Any, **kwargs: Any) -> nn.Module:
        return shard_rows(super().to_quantized(*args, **kwargs), self.parts)


class ShardedQuantizedSwitchLinear(SwitchRows, QuantizedSwitchLinear):
    """``QuantizedSwitchLinear`` in row shards (packed weight, scales, biases)."""

    def project_expert(self, x: mx.array, shard: dict[str, mx.array], expert: int, stream: mx.Stream) -> mx.array:
        one = {name: value[expert] for name, value in shard.items()}
        return quantized_project(x, one, self.group_size, self.bits, self.mode, stream)


SHARDED_CLASS: dict[type, type] = {
    nn.Linear: ShardedLinear,
    nn.QuantizedLinear: ShardedQuantizedLinear,
    nn.Embedding: ShardedEmbedding,
    nn.QuantizedEmbedding: ShardedQuantizedEmbedding,
    SwitchLinear: ShardedSwitchLinear,
    QuantizedSwitchLinear: ShardedQuantizedSwitchLinear,
}


class ShardedMLP(MLP):
    """The gated MLP with its gate (SwiGLU/GeGLU) computed shard by shard on each stream, so
    the gate and up outputs are never concatenated: one join, before ``down_proj``."""

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = self.gate_proj, self.up_proj
        if not (isinstance(gate, RowSharded) and isinstance(up, RowSharded)) or isinstance(gate, Adapted) \
                or isinstance(up, Adapted):
            return super().__call__(x)  # a layer type that has no sharded class, or one adding an adapter's output
        gate_shards, up_shards = gate.row_shards(), up.row_shards()
        hidden = []
        for gate_shard, up_shard, stream in zip(gate_shards, up_shards, worker_streams(len(gate_shards))):
            with mx.stream(stream):
                hidden.append(GATES[self.activation](gate.project_shard(x, gate_shard, stream), up.project_shard(x, up_shard, stream)))
        return self.down_proj(mx.concatenate(hidden, axis=-1))


class ShardedSwitchGLU(SwitchGLU):
    """The experts' gated MLP whose expert-sorted pairs, where it pays
    (``expert_counts.counting_pays``: a prompt's, never a decode step's), are counted per
    expert once for the block (one host read) and projected expert by expert by each of gate,
    up and down (``SwitchRows.project_counted``)."""

    def sorted_glu(self, rows: mx.array, indices: mx.array, decoding: bool) -> mx.array:
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        if not all(isinstance(p, SwitchRows) for p in projections):
            return super().sorted_glu(rows, indices, decoding)  # a layer type that has no sharded class
        experts = self.down_proj["weight"].shape[0]
        quantized = isinstance(self.down_proj, QuantizedSwitchLinear)
        if not counting_pays(indices.size, experts, quantized, decoding):
            return super().sorted_glu(rows, indices, decoding)
        bounds = expert_bounds(indices, experts)
        flat = rows.reshape(rows.shape[0], rows.shape[-1])  # (pairs, 1, hidden) -> (pairs, hidden)
        hidden = GATES[self.activation](self.gate_proj.project_counted(flat, bounds), self.up_proj.project_counted(flat, bounds))
        return self.down_proj.project_counted(hidden, bounds)[:, None, :]  # (pairs, hidden) -> (pairs, 1, hidden)


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


SHARDED_BLOCK: dict[type, type] = {MLP: ShardedMLP, SwitchGLU: ShardedSwitchGLU}


def shard_block(block: nn.Module) -> nn.Module:
    """``block`` (the gated MLP, the experts' ``SwitchGLU``) as its sharded class, holding the
    same sub-layers. Other block types (fused, mixtures) are returned unchanged."""
    sharded_class = SHARDED_BLOCK.get(type(block))
    if sharded_class is None:
        return block
    sharded = copy.copy(block)
    sharded.__class__ = sharded_class
    return sharded


def apply_thread_policy(model: Model, threads: int | None) -> None:
    """Split every projection and the vocabulary projection over ``threads`` CPU streams
    (``None``: ``default_threads()``; 1 leaves the model as it is). The sharded layers are
    part of the model tree (their classes show in ``named_modules()``) and slice whatever
    arrays they hold when called: weights may be cast, reloaded or quantized afterwards."""
    threads = default_threads() if threads is None else threads
    check_integer("threads", threads, low=1)
    if threads == 1:
        return
    if not on_cpu():
        raise MlxformerError(f"threads > 1 splits work over CPU streams, but the default device is {mx.default_device()}")
    for layer in model.layers:
        block = layer[layer.mlp_name]
        experts = [name for name in ("switch_mlp", "experts", "shared_expert") if name in block]  # mixture of experts
        for owner in (layer[layer.mixer_name], block, *(block[name] for name in experts)):
            for name in PROJECTIONS:
                if name in owner:
                    owner[name] = shard_rows(owner[name], threads)
        layer[layer.mlp_name] = shard_block(block)
        for name in experts:
            block[name] = shard_block(block[name])
    # the vocabulary projection: the tied embedding's ``as_linear`` or ``lm_head`` (absent
    # from a pipeline stage without the model's ends)
    owner, name = (model.model, "embed_tokens") if model.args.tie_word_embeddings else (model, "lm_head")
    if name in owner:
        owner[name] = shard_rows(owner[name], threads)
