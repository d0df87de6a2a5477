"""A sequence's place in a ``SpareBatch`` row, for one layer (``cache/rows.py``): what the row's
caches of every kind (``RowCache``, ``StateRowCache``) share."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence

import mlx.core as mx

if TYPE_CHECKING:
    from mlxformer.cache.batch import BatchLayout
    from mlxformer.cache.batch_kind import BatchRow


class RowHost(Protocol):
    """What a row's layer views ask of the batch the row lives in (``rows.SpareBatch``)."""

    @property
    def layers(self) -> Sequence[Any]:
        """Each layer's stacked rows."""
        ...

    @property
    def capacity(self) -> int:
        """Rows its buffers hold."""
        ...

    def index(self, row: "BatchRow") -> int:
        """Where ``row`` is in the buffers now."""
        ...


def move_back(layout: "BatchLayout", index: int, row: "BatchRow", target: int) -> None:
    """Row ``index`` back to its first ``target`` tokens: a row whose slots hold its tokens in
    order (a growing row, a ring not yet turned) frees its later slots; a turned ring's index
    steps back over the slots it frees (``freed``: written first, and skipped when it is read
    in time order). A hybrid's recurrent rows following the layout move it the same way."""
    kind = layout.kind
    layout.positions = layout.padded()
    if kind.capacity is None or row.used < kind.capacity:
        layout.positions[index, target:] = -1
        row.used = row.offset = row.idx = target
        return
    back, ring = row.offset - target, kind.capacity - kind.keep
    row.idx = kind.keep + (row.idx - kind.keep - back) % ring
    slots = mx.array([kind.keep + (row.idx - kind.keep + j) % ring for j in range(back)], dtype=mx.int32)
    layout.positions[index, slots] = -1
    row.offset, row.freed = target, row.freed + back


class RowPlace:
    """Layer ``layer`` of ``row`` in ``batch``; what a forward being built wrote there counts in
    ``pending`` (``pendings``: the row's layers', shared by their caches) until the forward is built (``rows.record_writes``)."""

    def __init__(self, batch: RowHost, row: "BatchRow", layer: int, pendings: dict[int, int]) -> None:
        self.batch, self.row, self.layer, self.pendings = batch, row, layer, pendings

    @property
    def pending(self) -> int:
        """Tokens written by the forward being built (< 0: trimmed back), not yet in the row."""
        return self.pendings[self.layer]

    @pending.setter
    def pending(self, tokens: int) -> None:
        self.pendings[self.layer] = tokens

    @property
    def offset(self) -> int:
        return self.row.offset + self.pending

    def recorded(self) -> None:
        """The forward's writes are recorded (``rows.record_writes``)."""
        self.pending = 0

    def _take_back(self, n: int) -> None:
        """Count ``n`` tokens trimmed: of the forward being built, then of the row, which moves
        back (``_move_back``) once every layer of it has been trimmed to the same length (a
        speculation round's rewind trims each layer by the same ``n``)."""
        self.pending -= n
        if self.pending < 0 and len(set(self.pendings.values())) == 1:
            self._move_back(self.offset)
            for layer in self.pendings:
                self.pendings[layer] = 0

    def _move_back(self, target: int) -> None:
        """Move the row back to its first ``target`` tokens (its later slots freed)."""
        raise NotImplementedError
