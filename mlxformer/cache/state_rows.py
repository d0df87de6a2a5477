"""Recurrent rows of a ``KVPool`` (issue 32, "KV in one place"): a hybrid model's Gated
DeltaNet layers keep each sequence's conv window and recurrent state in its row of the batch's
stacked buffers from admission on, as its attention layers keep their keys/values there
(``cache/pool.py``), so joining the decode steps copies nothing.

``StateRows`` is one recurrent layer of the batch: conv inputs ``(capacity, kernel - 1, C)`` and
states ``(capacity, H, Dk, Dv)``. In a decode step it gives the mixer the stepping rows only (the
attention layout's ``live`` rows, gathered; all rows when all step: no gather) and scatters their
new conv windows and states back, so a row that does not step (it prefills in its row, or is
free) keeps its state. ``StateRowCache`` is one recurrent layer of one row behind the cache
protocol: a prompt chunk reads the row's window and state and writes them back in place (the
other rows untouched), computing exactly what the sequence's own ``StateCache`` computes (the
same ``keep``, so the same split into the chunked and the recurrent form). A row keeps no past
states (``trim`` gives nothing back, as a batch's stacked ``StateCache`` did), except a
speculating sequence's (``BatchRow.rewinds``): its forwards, which run on its row alone, also
advance a ``StateCache`` of its own (a copy of the row's window and state, then the states of
its last ``keep`` tokens, as its own cache keeps them), so a rejected round is taken back by
that cache's ``trim`` and the state before it written back into the row. A row read out of
the batch (``StateRows.row``: that cache; ``StateRowCache.held``: a prefix-cache snapshot) is a
copy (a gather): a snapshot must own its bytes, not hold the pool's buffer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlxformer.cache.batch_kind import RECURRENT, Held
from mlxformer.cache.row_place import RowHost, RowPlace
from mlxformer.cache.state import StateCache, state_shapes

if TYPE_CHECKING:
    from mlxformer.cache.batch import BatchLayout
    from mlxformer.cache.batch_kind import BatchRow


def state_blank(args: Any, dtype: mx.Dtype) -> tuple[tuple[mx.array], tuple[mx.array]]:
    """A recurrent layer's conv window ``(1, kernel - 1, C)`` in ``dtype`` and float32 state
    ``(1, H, Dk, Dv)`` for one row of a layer of ``args`` (a ``ModelArgs``; lazy zeros, shapes only)."""
    conv, state = state_shapes(args)
    return (mx.zeros(conv, dtype),), (mx.zeros(state, mx.float32),)


class StateRows(StateCache):
    """One recurrent layer's rows of a ``KVPool``: the stacked ``StateCache`` of its decode
    steps, whose rows are written in place (module doc)."""

    def __init__(self, layout: "BatchLayout", conv: mx.array, state: mx.array) -> None:
        super().__init__()
        self.layout = layout  # the attention layers' (their ``live`` rows step)
        self.conv, self.states, self._width = conv, [state], conv.shape[1]

    def _stepping(self, x: mx.array) -> mx.array:
        live = self.layout.live
        return x if live is None else x[live]  # (B, ...) -> (D, ...)

    def conv_window(self, width: int, like: mx.array) -> mx.array:
        assert width == self._width
        return self._stepping(self.conv)

    def recurrent(self, batch: int, heads: int, key_dim: int, value_dim: int) -> mx.array:
        return self._stepping(self.states[0])

    def advance(self, inputs: mx.array, states: list[mx.array]) -> None:
        """The stepping rows' token: their new windows and states written back (the others keep theirs)."""
        window = mx.concatenate([self._stepping(self.conv), inputs], axis=1)[:, -self._width :]
        live = self.layout.live
        if live is None:
            self.conv, self.states = window, [states[-1]]
            return
        self.conv[live] = window
        self.states[0][live] = states[-1]

    def add_rows(self, extra: int) -> None:
        """``extra`` zero rows at the end (the batch doubles its rows)."""
        self.conv = mx.concatenate([self.conv, mx.zeros((extra, *self.conv.shape[1:]), self.conv.dtype)])
        state = self.states[0]
        self.states = [mx.concatenate([state, mx.zeros((extra, *state.shape[1:]), state.dtype)])]

    def write(self, index: int, conv: mx.array, state: mx.array) -> None:
        """Set row ``index``'s window ``(1, kernel - 1, C)`` and state ``(1, H, Dk, Dv)`` in place."""
        self.conv[index : index + 1] = conv
        self.states[0][index : index + 1] = state

    def keep_rows(self, rest: mx.array) -> None:
        """Keep rows ``rest`` only (a row leaves; under a KV budget the pool holds only the rows in use)."""
        self.conv, self.states = self.conv[rest], [self.states[0][rest]]

    def row(self, index: int, offset: int, keep: int) -> StateCache:
        """Row ``index`` as a cache of its own (``offset`` tokens, ``keep``): copies (module doc)."""
        take = mx.array([index])
        single = StateCache(keep)
        single.meta_state = {"offset": str(offset), "keep": str(keep)}  # type: ignore[misc]
        single.state = (self.conv[take], self.states[0][take])  # type: ignore[misc]
        return single


class StateRowCache(RowPlace):
    """One recurrent layer of one ``KVPool`` row behind the cache protocol (module doc); a
    chunk's tokens count in ``pending`` until the forward is built (``pool.record_writes``)."""

    def __init__(self, pool: RowHost, row: "BatchRow", layer: int, pendings: dict[int, int]) -> None:
        super().__init__(pool, row, layer, pendings)
        self.keep = max(1, int(row.metas[layer]["keep"]))  # the sequence's own cache's
        self._past: StateCache | None = None  # a speculating row's last states (module doc)

    @property
    def _rows(self) -> StateRows:
        rows = self.pool.layers[self.layer]
        assert isinstance(rows, StateRows)
        return rows

    def conv_window(self, width: int, like: mx.array) -> mx.array:
        index = self.index
        return self._rows.conv[index : index + 1]

    def recurrent(self, batch: int, heads: int, key_dim: int, value_dim: int) -> mx.array:
        index = self.index
        return self._rows.states[0][index : index + 1]

    def advance(self, inputs: mx.array, states: list[mx.array]) -> None:
        """Record a chunk ``(1, L, C)``: the row's new window and its state after the last token
        (a speculating row's last states kept too, ``_keep_past``)."""
        rows = self._rows
        window = mx.concatenate([self.conv_window(rows._width, inputs), inputs], axis=1)[:, -rows._width :]
        if self.row.rewinds:
            self._keep_past(inputs, states)
        rows.write(self.index, window, states[-1])
        self.pending += inputs.shape[1]

    def _keep_past(self, inputs: mx.array, states: list[mx.array]) -> None:
        """Advance a speculating row's own ``StateCache`` as its own cache would be (module doc):
        copied from the row when it does not hold the row's tokens (the first forward, or the row
        stepped in the batch); the state before a short update is its own, not the row's view
        (kept, a view would stop the pool's buffer from being written in place)."""
        past = self._past
        if past is None or past.offset != self.offset:
            past = self._past = self._rows.row(self.index, self.offset, self.keep)
        if inputs.shape[1] <= self.keep:  # ``delta_rule``: the first of ``states`` is the state before
            states = [past.states[-1], *states[1:]]
        past.advance(inputs, states)

    def reset(self, arrays: tuple[mx.array, ...]) -> None:
        """Start the row from a window and state (a prefix-cache hit's snapshot), or zeros (``()``)."""
        rows, index = self._rows, self.index
        if not arrays:
            arrays = (mx.zeros((1, *rows.conv.shape[1:]), rows.conv.dtype), mx.zeros((1, *rows.states[0].shape[1:]), mx.float32))
        rows.write(index, *arrays)

    def held(self) -> Held:
        """The row's window and state as data (copies, a gather: a prefix-cache snapshot owns its bytes)."""
        take, rows = mx.array([self.index]), self._rows
        return Held(RECURRENT, self.meta_state, self.row.offset, state=(rows.conv[take], rows.states[0][take]))

    @property
    def state(self) -> tuple[mx.array, ...]:
        """Views of the row's window and state."""
        index = self.index
        return self._rows.conv[index : index + 1], self._rows.states[0][index : index + 1]

    def trim(self, n: int) -> int:
        """Take back the last ``n`` tokens, a speculating row's (``StateCache.trim`` of its last
        states, the state then written back into the row); else nothing (module doc)."""
        past = self._past
        if not self.row.rewinds or past is None or past.offset != self.offset:
            return 0
        n = past.trim(n)
        if n:
            self._rows.write(self.index, *past.state)
            self._take_back(n)
        return n

