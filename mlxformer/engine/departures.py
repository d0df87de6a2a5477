"""How a sequence leaves the engine's batch (``Departures``): it fails alone, finishes (its
keys/values offered to the prefix cache, then its row freed), is cancelled, or is preempted to
be recomputed when there is room again."""

from __future__ import annotations

import logging
import math

import mlx.core as mx

from mlxformer.engine.memory import BLOCK, nbytes
from mlxformer.engine.parts import EngineParts
from mlxformer.engine.replay import taken_back
from mlxformer.engine.request_state import RequestState

log = logging.getLogger("mlxformer.engine")


class Departures:
    """A sequence's way out of the batch, with its caller told."""

    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts

    def fail(self, sequence: RequestState, error: BaseException) -> None:
        """End one sequence with ``error`` (raised by its handle's iterator)."""
        parts = self.parts
        sequence.finish("error")
        parts.replays.stop(sequence)
        parts.runner.release(sequence)
        parts.scheduler.release(sequence)
        parts.metrics.finished.labels("error").inc()
        handle = parts.handles.pop(id(sequence), None)
        if handle is not None:
            handle._put(error=error)

    def retire(self, sequence: RequestState) -> None:
        """Free a finished sequence's slot and offer its keys/values for prefix reuse (its
        blocks cut from its pool row: one copy)."""
        parts = self.parts
        parts.replays.stop(sequence)
        kept = bool(sequence.cache)
        if kept:
            try:  # the reply is whole: a cache that cannot be kept is only not reused
                self._keep(sequence)
            except Exception:
                log.exception("a finished request's cache could not be kept for prefix reuse")
        parts.runner.release(sequence)
        parts.scheduler.release(sequence)
        parts.handles.pop(id(sequence), None)
        if kept and parts.budget is not None:  # within what the active sequences leave
            parts.prefix_cache.evict_to(parts.budget.limit - parts.kv_bytes() + parts.prefix_cache.nbytes)

    def end(self, sequence: RequestState, reason: str) -> None:
        """End ``sequence`` early (cancelled) and tell its handle."""
        handle = self.parts.handles.get(id(sequence))
        sequence.finish(reason)
        self.retire(sequence)
        if handle is not None:
            event = sequence.event("", None)
            self.parts.metrics.event(handle, event)
            handle._put(event)

    def preempt(self, sequence: RequestState, keep_cache: bool = True) -> None:
        """Take ``sequence`` out of the batch to be recomputed when there is room again; its
        keys/values go to the prefix cache (kept while room allows) unless they cannot be trusted."""
        parts = self.parts
        parts.metrics.preemptions.inc()
        parts.sharing.waiting[:] = [s for s in parts.sharing.waiting if s is not sequence]
        parts.replays.stop(sequence)
        if keep_cache and sequence.cache_offset > sequence.cached_tokens:  # it computed something worth keeping
            self._keep(sequence)
        parts.runner.release(sequence)  # its blocks were taken by ``_keep``
        sequence.processed = 0
        parts.scheduler.preempt(sequence)

    def _keep(self, sequence: RequestState) -> None:
        """Offer the sequence's keys/values to the prefix cache, cut from its row (one copy, the
        blocks kept). The blocks are computed at once (under a KV budget before the row leaves),
        or a lazy block would keep the pool's old buffers alive. A pipelined step that fed its
        last token (it ended when that token was read) is taken back where every layer can (not
        a recurrent state: it is kept with every token it holds)."""
        layers = [c.held() for c in sequence.cache]
        if (ahead := sequence.cache_offset - (len(sequence.tokens) - 1)) > 0:
            layers = taken_back(layers, ahead)
        tokens = self._keepable(sequence.tokens[: layers[0].offset], sequence.cache_salt)
        blocks = self.parts.prefix_cache.insert(tokens, layers, sequence.cache_salt)
        arrays = [a for block in blocks for a in block.arrays()]
        if self.parts.budget is not None:
            mx.eval(arrays)
        else:
            mx.async_eval(arrays)

    def _keepable(self, tokens: list[int], salt: str) -> list[int]:
        """The tokens of a retiring sequence whose blocks the prefix cache may cut. Under a KV
        budget the new blocks are copies held beside the sequence's row until it leaves (one
        layer of the pool twice while it does), so they must fit in what the active sequences
        leave: older blocks are evicted first, then the blocks kept are cut short. Before, a
        request's retire held its KV twice (measured: MLX's peak 135.5 MiB over the weights,
        budget 112.5)."""
        parts = self.parts
        if parts.budget is None:
            return tokens
        cache, size, sizer = parts.prefix_cache, parts.prefix_cache.block_size, parts.planner.sizer
        per_token = sizer.bytes_for(BLOCK) / BLOCK
        active = sum(nbytes(s) for s in parts.active())
        room = parts.budget.limit - active - math.ceil(active * sizer.share(len(tokens)))
        missing = sum(key not in cache.blocks for key in cache.keys_for(tokens, salt=salt))
        new = math.ceil((missing * size + len(tokens) % size) * per_token)
        if cache.nbytes + new <= room:
            return tokens
        cache.evict_to(max(room - new, 0))  # the least recently used blocks make room first
        if new <= room:
            return tokens
        return tokens[: int(max(room, 0) // (per_token * size)) * size]
