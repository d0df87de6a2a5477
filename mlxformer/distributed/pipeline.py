"""Pipeline parallel: consecutive layers on each rank, hidden states passed around a ring.

Rank 0 holds the embedding, the final norm and the output projection (with a tied embedding
that is one matrix) plus the first layers; rank ``r`` holds the next ones. A step: rank 0
embeds and runs its layers, sends ``(B, T, hidden)`` to rank 1, ..., the last rank sends
the result back to rank 0, which normalizes, projects and samples. Layers are split so each
rank holds about the same bytes. Every rank keeps the KV cache of its own layers.

Before each hidden-state message a rank sends a 4-int header ``(B, T, dtype, RoPE length)`` so
the next one knows what to receive and rotates a chunk of a prompt as the whole prompt (LongRoPE
and dynamic NTK depend on its length; 0: the chunk's own end); ``T = 0`` ends the followers' loop
and ``T = -1`` resets their caches.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx

from mlxformer.cache import Cache, CacheSettings, make_cache
from mlxformer.distributed.watchdog import Watchdog
from mlxformer.errors import MlxformerError
from mlxformer.formats.checkpoint import Checkpoint
from mlxformer.loader import apply_dtype_policy, loaded_model
from mlxformer.models.decoder import Model
from mlxformer.tools.planning import footprint

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
STOP, RESET = 0, -1
HEADER_SIZE = 4  # batch, length (or STOP/RESET), dtype index, RoPE length (0: none)
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Stage:
    """One rank's part of the pipeline: layers ``start:stop``; rank 0 also holds the ends."""

    rank: int
    size: int
    start: int
    stop: int

    @property
    def with_ends(self) -> bool:
        return self.rank == 0


def plan_stages(layer_bytes: list[int], ends_bytes: int, size: int) -> list[Stage]:
    """Split layers into ``size`` consecutive runs of at least one layer each, so that every
    rank holds about the same bytes (rank 0 also holds ``ends_bytes``)."""
    n = len(layer_bytes)
    if size > n:
        raise MlxformerError(f"a pipeline of {size} ranks needs at least {size} layers; the model has {n}")
    total = ends_bytes + sum(layer_bytes)
    cuts, held = [0], ends_bytes
    for r in range(1, size):
        target = total * r / size
        cut = cuts[-1] + 1  # at least one layer on the previous rank
        held += layer_bytes[cut - 1]
        while cut < n - (size - r) and abs(held + layer_bytes[cut] - target) < abs(held - target):
            held += layer_bytes[cut]
            cut += 1
        cuts.append(cut)
    cuts.append(n)
    return [Stage(r, size, cuts[r], cuts[r + 1]) for r in range(size)]


def stage_for(checkpoint: Checkpoint, rank: int, size: int) -> Stage:
    """This rank's stage of ``checkpoint``'s model, planned from the tensor headers."""
    layer_bytes = [0] * checkpoint.args.num_hidden_layers
    ends = 0
    for entry in footprint(checkpoint).tensors:
        match = _LAYER_KEY.match(entry.name)
        if match:
            layer_bytes[int(match.group(1))] += entry.loaded_bytes
        else:
            ends += entry.loaded_bytes
    return plan_stages(layer_bytes, ends, size)[rank]


def _local_name(name: str, stage: Stage) -> str | None:
    """The stage-local name of checkpoint tensor ``name`` (layers renumbered from 0), or
    ``None`` when another rank holds it."""
    match = _LAYER_KEY.match(name)
    if match is None:
        return name if stage.with_ends else None
    index = int(match.group(1))
    if not stage.start <= index < stage.stop:
        return None
    return f"model.layers.{index - stage.start}.{match.group(2)}"


def load_stage(checkpoint: Checkpoint, stage: Stage, dtype: mx.Dtype | None = None) -> Model:
    """The decoder holding ``stage``'s layers (and ends), reading only their tensors."""
    used = checkpoint.weights
    weights = checkpoint.read(used.subset(name for name in used if _local_name(name, stage) is not None))
    local = {local_name: array for name, array in weights.items() if (local_name := _local_name(name, stage))}
    quantization = checkpoint.quantization
    if quantization:  # per-layer overrides follow the renumbering
        overrides = {k: v for k, v in quantization.items() if isinstance(v, dict)}
        quantization = {k: v for k, v in quantization.items() if k not in overrides}
        quantization.update({_local_name(k, stage): v for k, v in overrides.items() if _local_name(k, stage)})
    model = loaded_model(checkpoint.args, local, quantization, stage.stop - stage.start, stage.with_ends, stage.start)
    apply_dtype_policy(model, dtype)
    return model


class PipelineLink:
    """Rank 0's view of the other stages: ``model.use_remote_layers(link)`` sends hidden
    states through them and returns what the last one sends back."""

    def __init__(self, group: mx.distributed.Group, watchdog: Watchdog) -> None:
        self.group, self.watchdog = group, watchdog
        self.size = group.size()

    def _send_header(self, batch: int, length: int, dtype: mx.Dtype, rope_length: int | None = None) -> None:
        header = mx.array([batch, length, DTYPES.index(dtype), rope_length or 0], dtype=mx.int32)
        with self.watchdog.guard("sending to rank 1"):
            mx.eval(mx.distributed.send(header, 1, group=self.group))

    def __call__(self, h: mx.array, rope_length: int | None = None) -> mx.array:
        B, T, _ = h.shape
        mx.eval(h)  # our own layers, outside the watchdog's countdown
        self._send_header(B, T, h.dtype, rope_length)
        with self.watchdog.guard("sending hidden states to rank 1"):
            mx.eval(mx.distributed.send(h, 1, group=self.group))
        with self.watchdog.guard(f"waiting for rank {self.size - 1}"):
            out = mx.distributed.recv(h.shape, h.dtype, self.size - 1, group=self.group)
            mx.eval(out)
        return out

    def reset(self) -> None:
        """Make every other stage start new caches (a new conversation)."""
        self._send_header(0, RESET, mx.float32)

    def stop(self) -> None:
        """End the other stages' loops."""
        self._send_header(0, STOP, mx.float32)


def serve_stage(
    model: Model, group: mx.distributed.Group, watchdog: Watchdog, settings: CacheSettings | None = None
) -> None:
    """A follower's loop: receive hidden states, run this stage's layers with their caches,
    pass them on; until rank 0 says stop."""
    rank, size = group.rank(), group.size()
    previous, following = rank - 1, (rank + 1) % size
    cache: list[Cache] = make_cache(model, settings)
    while True:
        with watchdog.guard(f"waiting for rank {previous}"):
            header = mx.distributed.recv((HEADER_SIZE,), mx.int32, previous, group=group)
            mx.eval(header)
        batch, length, dtype_index, rope_length = header.tolist()
        if following != 0:
            with watchdog.guard(f"sending to rank {following}"):
                mx.eval(mx.distributed.send(header, following, group=group))
        if length == STOP:
            return
        if length == RESET:
            cache = make_cache(model, settings)
            continue
        with watchdog.guard(f"waiting for rank {previous}"):
            h = mx.distributed.recv((batch, length, model.args.hidden_size), DTYPES[dtype_index], previous, group=group)
            mx.eval(h)
        h = model.run_layers(h, cache, rope_length or None).astype(DTYPES[dtype_index])
        mx.eval(h)  # our own layers, outside the watchdog's countdown
        with watchdog.guard(f"sending hidden states to rank {following}"):
            mx.eval(mx.distributed.send(h, following, group=group))
