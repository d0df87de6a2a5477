"""A sequence's place in a ``SpareBatch`` row, for one layer (``cache/rows.py``): what the row's
caches of every kind (``RowCache``, ``StateRowCache``) share."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlxformer.cache.batch import Row
    from mlxformer.cache.rows import SpareBatch


class RowPlace:
    """Layer ``layer`` of ``row`` in ``batch``; what a forward being built wrote there counts in
    ``pending`` (``pendings``: the row's layers', shared by their caches) until ``settle``."""

    def __init__(self, batch: "SpareBatch", row: "Row", layer: int, pendings: dict[int, int]) -> None:
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

    def settled(self) -> None:
        """The forward's writes are recorded (``settle``)."""
        self.pending = 0
