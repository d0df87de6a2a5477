"""One forward for a whole engine step: segments of tokens packed side by side on one row.

A step's tokens (every decoding row's one token, then each prompt chunk's tokens) go through
the decoder as one ``(1, T)`` row, so every projection, norm and MLP runs once for all of them
(the weights are read once per step: what a GPU's memory-bound step pays for). Attention is
the only part that needs to know whose token is whose: ``PackedLayerCache`` is one layer's
cache for that row; it cuts the packed keys, values and queries back into segments, each
written to and attended over by its own cache (a pool's layer for its decode rows, a row's
view for its chunk or speculation round), with that cache's own mask. RoPE rotates each token at
its own position (``offset`` is ``(1, T)``). Each segment therefore computes exactly what it
computes in a forward of its own: a matmul's rows do not depend on the other rows. MLA's latent
attention (``models/mla.py``) writes and attends its segments through ``each`` too, in the
order grouped-query attention does. A recurrent layer (Gated DeltaNet) cuts its projected rows
the same way (``cut_tokens``) and scans each segment from that segment's own state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx

from mlxformer.cache.protocol import Cache
from mlxformer.models.mask import Mask


# A segment's attention: its index, its keys/values as its cache returned them (or fetched) and
# its mask -> its outputs packed, ``(1, heads, n, D)`` (None: none of its rows are wanted)
Attend = Callable[[int, Any, Any, Mask], Optional[mx.array]]


@dataclass(frozen=True)
class StepSegment:
    """A run of packed tokens: ``rows`` sequences of ``length`` tokens each, stored in ``cache``
    (a batch layer's cache when ``rows > 1``, whose rows each take one token)."""

    cache: Cache
    rows: int
    length: int

    @property
    def tokens(self) -> int:
        return self.rows * self.length


def positions(segments: Sequence[StepSegment]) -> mx.array:
    """Each packed token's position ``(1, T)``, from the segments' caches before the step (a
    cache taking several segments, a prompt's consecutive chunks, continues where the last ended)."""
    parts, ahead = [], {}  # id(cache) -> tokens its earlier segments add
    for segment in segments:
        offset = segment.cache.offset
        if isinstance(offset, mx.array):  # a batch: (rows,) offsets, one token each
            parts.append(offset.astype(mx.int32))
            continue
        start = offset + ahead.get(id(segment.cache), 0)
        ahead[id(segment.cache)] = start - offset + segment.length
        parts.append(mx.arange(start, start + segment.length, dtype=mx.int32))
    return mx.concatenate(parts)[None]


def pack_segment(x: mx.array, segment: StepSegment) -> mx.array:
    """A decode batch's ``(rows, H, 1, D)`` as packed ``(1, H, rows, D)`` (``cut_tokens``'s
    inverse for one segment); a chunk's segment is already one row."""
    return x if segment.rows == 1 else x.swapaxes(0, 2)


def cut_tokens(x: mx.array, segments: Sequence[StepSegment], axis: int = 1) -> list[mx.array]:
    """Packed ``x`` whose tokens run along ``axis`` (``(1, T, ...)``; attention's ``(1, heads, T,
    D)`` with ``axis`` 2) cut into each segment's part, a decode batch's rows moved to axis 0
    (``(rows, 1, ...)``; ``(rows, heads, 1, D)``)."""
    parts, start = [], 0
    for segment in segments:
        part = x[(slice(None),) * axis + (slice(start, start + segment.tokens),)]
        parts.append(part if segment.rows == 1 else part.swapaxes(0, axis))
        start += segment.tokens
    return parts


def join_tokens(parts: Sequence[mx.array], segments: Sequence[StepSegment]) -> mx.array:
    """Inverse of ``cut_tokens``."""
    return mx.concatenate([p if s.rows == 1 else p.swapaxes(0, 1) for p, s in zip(parts, segments)], axis=1)


class PackedLayerCache:
    """One layer's cache for a packed step: each segment's tokens go to its own cache."""

    def __init__(self, segments: Sequence[StepSegment], window: int | None, offset: mx.array, read: bool = False) -> None:
        self.segments, self.window = list(segments), window
        self.offset = offset  # (1, T): RoPE rotates each token at its own position
        # ``read``: a later layer attends over this one's keys/values (``kv_source``); each
        # segment's keys, values and mask are then kept once written (held only then: a
        # reference to a written buffer would stop MLX writing it in place in the next step)
        self.read = read
        self._attended: list[tuple[Any, Any, Mask]] | None = None

    def cut(self, x: mx.array) -> list[mx.array]:
        """Packed ``(1, heads, T, D)`` cut into each segment's ``(rows, heads, length, D)``."""
        return cut_tokens(x, self.segments, axis=2)

    def kept(self, keep: mx.array | None) -> list[list[int] | None]:
        """Each segment's tokens among the packed positions ``keep`` (ascending, as a packed step
        passes them: made on the host, read back without waiting), counted from the segment's
        first; None where every one is kept."""
        if keep is None:
            return [None] * len(self.segments)
        wanted, start, parts = keep.tolist(), 0, []
        assert wanted == sorted(wanted), "a packed step keeps its rows in packed order"
        for segment in self.segments:
            rows = [k - start for k in wanted if start <= k < start + segment.tokens]
            parts.append(None if len(rows) == segment.tokens else rows)
            start += segment.tokens
        return parts

    def make_mask(self, query_len: int, window: int | None) -> Mask:
        return None  # each segment's own mask is taken when it attends

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        return keys, values  # written segment by segment in ``attention``

    def attention(
        self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Mask,
        softcap: float | None = None, sinks: mx.array | None = None,
    ) -> mx.array:
        """Each segment's queries over its keys/values (written to its cache, ``each``), packed
        ``(1, heads, T, D)`` out. A layer reading this one's keys/values (Gemma 4's KV sharing,
        ``kv_source``) calls this again: each of its segments attends over what this layer's
        segment attended over, nothing written twice."""
        parts = self.cut(queries)

        def attend(i: int, keys: Any, values: Any, mask: Mask) -> mx.array:
            segment = self.segments[i]
            return pack_segment(segment.cache.attention(parts[i], keys, values, scale, mask, softcap, sinks), segment)

        if self._attended is not None:
            return mx.concatenate([attend(i, *kvm) for i, kvm in enumerate(self._attended)], axis=2)
        return mx.concatenate(self.each(self.cut(keys), self.cut(values), attend), axis=2)  # type: ignore[arg-type]

    def each(self, keys: Sequence[Any], values: Sequence[Any], attend: Attend) -> list[mx.array | None]:
        """Every segment's mask and write (its ``keys``/``values``, ``(rows, heads, length, D)``
        each), then every segment's ``attend`` over what its cache ``fetch``es once all are
        written; the outputs in segment order. A decode batch's layer and a prompt chunk's row in
        it share one buffer, and an attention reading it before the row's write would keep the
        old buffer alive, so that MLX copies the whole layer for the write instead of writing in
        place (each step a chunk rode beside decoding rows). A ring row's chunk writes where it
        attends (piece by piece): it attends before the fetching ones. A cache taking two
        segments (a prompt's consecutive chunks) writes and attends in turn: the first's
        attention must not see the second's keys, nor its codec."""
        if len({id(segment.cache) for segment in self.segments}) < len(self.segments):
            attended, outs = [], []
            for i, (segment, k, v) in enumerate(zip(self.segments, keys, values)):  # each attends before the next writes
                attended.append(self._write(segment, k, v))
                outs.append(attend(i, *attended[-1]))
            self._attended = attended if self.read else None
            return outs
        written = [self._write(segment, k, v) for segment, k, v in zip(self.segments, keys, values)]
        outs: list[mx.array | None] = [None] * len(written)
        fetches = [getattr(segment.cache, "fetch", None) for segment in self.segments]
        # caches writing where they attend (a ring row, piece by piece) first, then the fetching ones
        for i in sorted(range(len(written)), key=lambda i: fetches[i] is not None):
            fetch = fetches[i]
            if fetch is not None:
                written[i] = (*fetch(), written[i][2])
            outs[i] = attend(i, *written[i])
        self._attended = written if self.read else None
        return outs

    def _write(self, segment: StepSegment, keys: mx.array, values: mx.array) -> tuple[Any, Any, Mask]:
        """A segment's keys/values written to its cache; what it returns, and its mask (taken before)."""
        own = segment.cache.make_mask(segment.length, self.window)
        return (*segment.cache.update_and_fetch(keys, values), own)
