"""Batched decode storage: B sequences' keys/values of one layer in one buffer of slots.

A ``BatchLayout`` (shared by the layers that store alike: all of them, or, in a model mixing
sliding-window and global layers such as Gemma 2/3, each kind's) records which absolute
position each slot of each row holds, in a ``(B, C)`` device array: a step's slots, offsets and
mask are built from it with MLX ops, so the host's work per step is a few numbers per row,
whatever the context; a ``BatchLayerCache`` holds one layer's buffers ``(B, n_kv, C, ...)``. A
decode step writes every row's new key/value at that row's own slot with one scatter per array
and attends over all ``C`` slots of all rows in one call, masked by position. The slots are the
ones the sequence's own cache would use (the growing cache appends; the rotating cache fills,
then writes its ring after the sinks), so each row sees exactly the keys it sees alone.

The rows belong to a pool (``cache/pool.py``), where a sequence lives from admission to
retirement; a row's layer views say what it holds as data (``held()``: what the prefix cache
cuts blocks from).
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence

import mlx.core as mx

from mlxformer.cache.batch_kind import BatchRow, StorageKind
from mlxformer.cache.codec import CENTER_BLOCK, KVCodec, Pack, pack_nbytes
from mlxformer.cache.latent import Expand, latent_attention
from mlxformer.models.mask import Mask

STEP = 256  # slots are added in steps, like the growing cache's buffers


def in_window(visible: mx.array, positions: mx.array, query: mx.array, kind: StorageKind, window: int | None) -> mx.array:
    """``visible`` (keys at ``positions``, queries at ``query``) narrowed to what the window
    shows: a rotating cache's sinks and last ``max_size - keep`` tokens, a sliding ``window``."""
    if kind.max_size is not None:
        visible = visible & ((positions < kind.keep) | (positions > query - (kind.max_size - kind.keep)))
    if window is not None:
        visible = visible & (positions > query - window)
    return visible


Span = tuple[int, int, int]  # (first slot, first token of the chunk, tokens)


def ring_spans(used: int, idx: int, capacity: int | None, keep: int, count: int) -> tuple[list[Span], int, int]:
    """Where ``count`` tokens go in a row with ``used`` slots and ring index ``idx`` (the
    slots fill, then the ring over ``keep..capacity-1`` turns; ``capacity`` None: a growing
    row, which never turns); the spans in token order (a later span may overwrite an earlier
    one's slots) and the row's ``used`` and ``idx`` after."""
    capacity = sys.maxsize if capacity is None else capacity
    spans: list[Span] = []
    token = 0
    if used < capacity and count:
        token = min(count, capacity - used)
        spans.append((used, 0, token))
        used += token
        idx = used if used < capacity else keep
    while token < count:
        n = min(count - token, capacity - idx)
        spans.append((idx, token, n))
        token += n
        idx = idx + n if idx + n < capacity else keep
    return spans, used, idx


class BatchLayout:
    """Which position each slot of each row holds; the slots, offsets and mask of the next step."""

    def __init__(self, kind: StorageKind, window: int | None) -> None:
        self.kind, self.window = kind, window
        self.rows: list[BatchRow] = []
        self.width = 0  # C: slots per row in the buffers
        self.step_width = 0  # C at ``prepare``: this step's mask (a prompt chunk in a row may widen ``width``)
        self.positions = mx.zeros((0, 0), dtype=mx.int32)  # (B, C') position held by each slot, -1: empty
        self.slots: mx.array | None = None  # (B,) this step's slot of each row
        self.offsets: mx.array | None = None  # (B,) this step's position of each row
        self.mask: mx.array | None = None  # (B, 1, 1, C) the slots each row's query sees
        self.key_blocks: mx.array | None = None  # (B, C) each slot's key-center block
        self.query_blocks: mx.array | None = None  # (B, 1) the key-center block of this step's token
        self._next: mx.array | None = None  # (B, C) the positions once this step's token is written
        # when only some rows step (the others prefill in their rows, or are free: ``cache/pool.py``)
        self.live: mx.array | None = None  # (D,) the stepping rows
        self.spread: mx.array | None = None  # (B,) for each row, the stepping row whose token it takes
        self.rope: mx.array | None = None  # (D,) the stepping rows' positions
        self._stepping: list[int] | None = None

    def slot_of(self, row: BatchRow) -> int:
        """Where ``row`` writes its next token."""
        capacity = self.kind.capacity
        return row.used if capacity is None or row.used < capacity else row.idx

    def fit(self, slots_needed: int) -> None:
        """Grow the width (in steps, never past the capacity) to hold ``slots_needed`` slots."""
        if slots_needed > self.width:
            width = -(-slots_needed // STEP) * STEP
            self.width = width if self.kind.capacity is None else min(width, self.kind.capacity)

    def padded(self) -> mx.array:
        """The positions ``(B, C)``: slots past the ones recorded hold -1 (empty)."""
        short = self.width - self.positions.shape[1]
        if short > 0:
            empty = mx.full((self.positions.shape[0], short), -1, dtype=mx.int32)
            self.positions = mx.concatenate([self.positions, empty], axis=1)
        return self.positions[:, : self.width]

    def prepare(self, stepping: Sequence[int] | None = None) -> None:
        """Choose this step's slots and build its offsets and mask (call before the forward):
        O(B) host work, the (B, C) arrays are MLX ops. ``stepping``: the rows that take a token
        (default: all); each other row writes a copy of one at its next slot (its scratch: not
        recorded, and its next prompt chunk writes there) and attends to it alone."""
        if stepping is not None and len(stepping) == len(self.rows):
            stepping = None
        self._stepping = None if stepping is None else list(stepping)
        slots = [self.slot_of(r) for r in self.rows]
        self.fit(max(slots) + 1)
        self.step_width = self.width
        self.slots = mx.array(slots, dtype=mx.int32)
        self.offsets = mx.array([r.offset for r in self.rows], dtype=mx.int32)
        query = self.offsets[:, None]  # (B, 1)
        positions = mx.put_along_axis(self.padded(), self.slots[:, None], query, axis=1)  # (B, C)
        self.live = self.spread = self.rope = None
        self._next, visible = positions, (positions >= 0) & (positions <= query)
        if stepping is not None:
            spread = [0] * len(self.rows)
            for j, i in enumerate(stepping):
                spread[i] = j
            self.live, self.spread = mx.array(stepping, dtype=mx.int32), mx.array(spread, dtype=mx.int32)
            self.rope = mx.array([self.rows[i].offset for i in stepping], dtype=mx.int32)
            moving = set(stepping)
            others = mx.array([i not in moving for i in range(len(self.rows))])  # (B,)
            # the others attend to their scratch slot alone (a softmax over nothing is NaN)
            scratch = mx.arange(positions.shape[1])[None] == self.slots[:, None]  # (B, C)
            self._next = mx.where(others[:, None], self.padded(), positions)
            visible = mx.where(others[:, None], scratch, visible)
        visible = in_window(visible, positions, query, self.kind, self.window)
        self.mask = visible[:, None, None, :]  # (B, 1, 1, C)
        self.key_blocks = mx.maximum(positions, 0) // CENTER_BLOCK
        self.query_blocks = query // CENTER_BLOCK

    def commit(self) -> None:
        """Record this step's token in every stepping row (call after the forward is built; a
        recurrent layer's rows follow the first attention layout's, ``KVPool.layouts``)."""
        assert self._next is not None, "prepare() first"
        self.positions, self._next = self._next, None
        stepping = self.rows if self._stepping is None else [self.rows[i] for i in self._stepping]
        for row in stepping:
            _, row.used, row.idx = ring_spans(row.used, row.idx, self.kind.capacity, self.kind.keep, 1)
            row.offset, row.freed = row.offset + 1, max(0, row.freed - 1)

    def remove(self, index: int, keep: mx.array) -> None:
        """Remove row ``index`` (``keep``: the other rows' indices); the width narrows to what
        the rows left need."""
        self.rows.pop(index)
        self.width = 0
        self.fit(max((r.used for r in self.rows), default=0) + 1)
        self.positions = self.positions[keep][:, : self.width]


def pad_pack(pack: Pack, width: int, rows: int = 0) -> Pack:
    """``pack`` with zero slots appended up to ``width`` and ``rows`` zero rows. One ``mx.pad``
    per array: its output is new, and written in place by the row that takes it (a
    concatenation with zeros materializes the zeros, and one with an empty pool is a view the
    write copies: a layer held twice more, measured)."""
    short = max(0, width - pack[0].shape[2])
    if not short and not rows:
        return pack
    return tuple(mx.pad(x, [(0, rows), (0, 0), (0, short), (0, 0)]) for x in pack)


def _write(buffer: mx.array, slots: mx.array, new: mx.array) -> mx.array:
    """``buffer`` (B, n_kv, C, d) with row b's slot ``slots[b]`` set to ``new[b]`` (B, n_kv, 1, d)."""
    index = mx.broadcast_to(slots[:, None, None, None], new.shape)  # (B, n_kv, 1, d)
    return mx.put_along_axis(buffer, index, new, axis=2)


class BatchLayerCache:
    """One layer's keys/values for the rows of a ``BatchLayout``, behind the cache protocol."""

    segments = None  # the rows of one forward (``Cache.segments``)

    def __init__(self, layout: BatchLayout, codec: KVCodec, keys: Pack, values: Pack) -> None:
        self.layout, self.codec, self.keys, self.values = layout, codec, keys, values

    @property
    def offset(self) -> mx.array:  # type: ignore[override]
        assert self.layout.offsets is not None, "prepare() the layout first"
        return self.layout.offsets if self.layout.rope is None else self.layout.rope  # the stepping rows'

    def make_mask(self, query_len: int, window: int | None) -> Mask:
        assert query_len == 1 and self.layout.mask is not None, "a batch decodes one token per row"
        return self.layout.mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Pack, Pack]:
        width, slots = self.layout.step_width, self.layout.slots
        assert slots is not None
        if self.layout.spread is not None:  # the stepping rows' (D, ...) to every row's (B, ...)
            keys, values = keys[self.layout.spread], values[self.layout.spread]
        self.keys, self.values = pad_pack(self.keys, width), pad_pack(self.values, width)
        if self.codec.key_center is not None:  # a row entering a new block keeps its last center
            self.codec = self.codec.covering(max(r.offset for r in self.layout.rows) // CENTER_BLOCK + 1)
        assert self.layout.query_blocks is not None
        new_keys, new_values = self.codec.encode_keys(keys, self.layout.query_blocks), self.codec.encode(values)
        self.keys = tuple(_write(b, slots, n) for b, n in zip(self.keys, new_keys))
        self.values = tuple(_write(b, slots, n) for b, n in zip(self.values, new_values))
        return self.fetch()

    def fetch(self) -> tuple[Pack, Pack]:
        """The keys/values this step's rows attend over: the buffers as written so far (a row's
        prompt chunk written after the rows' tokens, ``cache/packed.py``), as wide as the step's
        mask (the chunk may have widened them)."""
        width = self.layout.step_width
        if self.keys[0].shape[2] <= width:
            return self.keys, self.values
        return tuple(x[:, :, :width] for x in self.keys), tuple(x[:, :, :width] for x in self.values)

    def attention(
        self, queries: mx.array, keys: Pack, values: Pack, scale: float, mask: Mask, softcap: float | None = None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        if (self.codec.bits is not None or softcap is not None) and isinstance(mask, mx.array):
            mask = mask[:, None]  # (B, 1, 1, 1, C) against the (B, n_kv, n_rep, 1, C) scores
        return self._on_rows((queries,), lambda q: self.codec.attention(
            q, keys, values, scale, mask, softcap, self.layout.key_blocks, sinks))

    def latent_attention(
        self, q_latent: mx.array, q_rope: mx.array, keys: Pack, values: Pack, scale: float, mask: Mask
    ) -> mx.array:
        return self._on_rows((q_latent, q_rope), lambda ql, qr: latent_attention(
            self.codec, ql, qr, keys, values, scale, mask, self.layout.key_blocks))

    def expanded_attention(
        self, q_nope: mx.array, q_rope: mx.array, keys: Pack, values: Pack, mask: Mask, expand: Expand
    ) -> mx.array:
        return self._on_rows((q_nope, q_rope), lambda qn, qr: expand(qn, qr, keys[0], values[0], mask))

    def _on_rows(self, queries: tuple[mx.array, ...], attend: Callable[..., mx.array]) -> mx.array:
        """``attend`` on the step's queries spread over every row of the buffer (``(D, heads, L,
        dim)`` -> ``(B, ...)``, when only some rows decode), its output cut back to theirs."""
        spread, live = self.layout.spread, self.layout.live
        out = attend(*(q if spread is None else q[spread] for q in queries))
        return out if live is None else out[live]

    def keep_rows(self, rest: mx.array) -> None:
        """Keep rows ``rest`` only (a row leaves), their slots up to the layout's width."""
        width = self.layout.width
        self.keys = tuple(x[rest][:, :, :width] for x in self.keys)
        self.values = tuple(x[rest][:, :, :width] for x in self.values)
        if self.codec.key_center is not None:
            self.codec = self.codec.centered(self.codec.key_center[rest])

    @property
    def state(self) -> tuple[mx.array, ...]:
        return self.keys + self.values + self.codec.state

    @property
    def nbytes(self) -> int:
        return pack_nbytes(self.keys) + pack_nbytes(self.values)
