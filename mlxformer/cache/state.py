"""The cache of a recurrent (Gated DeltaNet) layer: a fixed-size state, not keys and values.

It holds the last inputs of the layer's causal conv1d and the recurrent state after each of
the last ``keep`` tokens, so ``trim(n)`` takes back up to ``keep`` tokens exactly as a KV cache
forgets keys: a pipelined decode step's extra token (``keep`` is at least 1) and a rejected
speculation round (``keep`` = the rewind slack speculation asks for). Further back nothing can
be recovered, so ``trim`` returns fewer than asked, as a rotating cache that has evicted does.
``state`` is the current conv window and recurrent state; ``meta_state`` the token count.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

from mlxformer.cache.batch_kind import RECURRENT, Held
from mlxformer.models.mask import Mask, causal_mask_for


def state_shapes(args: Any) -> tuple[tuple[int, int, int], tuple[int, int, int, int]]:
    """What one sequence's ``state`` holds for a recurrent layer of ``args`` (a ``ModelArgs``):
    the conv window ``(1, kernel - 1, C)`` and the recurrent state ``(1, H, Dk, Dv)``."""
    conv_dim = 2 * args.linear_num_key_heads * args.linear_key_head_dim + args.linear_num_value_heads * args.linear_value_head_dim
    return ((1, args.linear_conv_kernel_dim - 1, conv_dim),
            (1, args.linear_num_value_heads, args.linear_key_head_dim, args.linear_value_head_dim))


def state_nbytes(args: Any, keep: int, dtype: mx.Dtype) -> int:
    """Bytes a ``StateCache`` keeping ``keep`` tokens holds for a layer of ``args`` (a
    ``ModelArgs``) whatever the context length: conv inputs in ``dtype``, float32 states."""
    (_, width, conv_dim), state = state_shapes(args)
    return (width + keep) * conv_dim * dtype.size + (keep + 1) * math.prod(state) * 4


class StateCache:
    """A recurrent layer's conv inputs ``(B, kernel - 1 + kept, C)`` and states ``(B, H, Dk, Dv)``."""

    segments = None  # the rows of one forward (``Cache.segments``)

    def __init__(self, rewind: int = 0) -> None:
        self.keep = max(1, rewind)  # tokens that can be taken back
        self.conv: mx.array | None = None  # the last conv inputs, oldest first
        self.states: list[mx.array] = []  # the recurrent state at the last len(states) positions
        self.offset = 0
        self._width = 0  # conv inputs the layer reads before each update (kernel - 1)

    def conv_window(self, width: int, like: mx.array) -> mx.array:
        """The ``width`` conv inputs before the next update (zeros before the first token)."""
        if self.conv is None:
            self.conv = mx.zeros((like.shape[0], width, like.shape[-1]), dtype=like.dtype)
        self._width = width
        return self.conv[:, self.conv.shape[1] - width :]

    def recurrent(self, batch: int, heads: int, key_dim: int, value_dim: int) -> mx.array:
        """The current recurrent state (zeros before the first token)."""
        if not self.states:
            self.states = [mx.zeros((batch, heads, key_dim, value_dim), dtype=mx.float32)]
        return self.states[-1]

    def advance(self, inputs: mx.array, states: list[mx.array]) -> None:
        """Record an update: its conv inputs ``(B, L, C)`` and ``states``, those at the last
        ``min(L, keep) + 1`` positions (the first equal to the current one when ``L <= keep``)."""
        assert self.conv is not None
        self.conv = mx.concatenate([self.conv, inputs], axis=1)[:, -(self._width + self.keep) :]
        self.states = (self.states[:-1] + states)[-(self.keep + 1) :]
        self.offset += inputs.shape[1]

    def make_mask(self, query_len: int, window: int | None) -> Mask:
        return causal_mask_for(query_len, self.offset + query_len, window)

    @property
    def state(self) -> tuple[mx.array, ...]:
        if self.conv is None or not self.states:
            return ()
        return self.conv[:, self.conv.shape[1] - self._width :], self.states[-1]

    @state.setter
    def state(self, arrays: tuple[mx.array, ...]) -> None:
        """Set after ``meta_state`` (which carries the token count)."""
        if not arrays:
            self.conv, self.states = None, []
            return
        conv, recurrent = arrays
        self.conv, self.states, self._width = conv, [recurrent], conv.shape[1]

    @property
    def meta_state(self) -> dict[str, str]:
        return {"offset": str(self.offset), "keep": str(self.keep)}

    @meta_state.setter
    def meta_state(self, meta: dict[str, str]) -> None:
        self.offset, self.keep = int(meta["offset"]), max(1, int(meta["keep"]))

    def held(self) -> Held:
        """Its window and state, as data (``Held``)."""
        return Held(RECURRENT, self.meta_state, self.offset, state=self.state)

    def reserve_rewind(self, slack: int) -> None:
        """Keep the states of at least ``slack`` tokens from now on (speculative decoding)."""
        self.keep = max(self.keep, slack)

    def trim(self, n: int) -> int:
        n = min(n, len(self.states) - 1, self.offset)
        if n <= 0:
            return 0
        assert self.conv is not None
        self.conv = self.conv[:, : self.conv.shape[1] - n]
        self.states = self.states[:-n]
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        held = sum(s.nbytes for s in self.states)
        return held + (self.conv.nbytes if self.conv is not None else 0)
