"""RoPE variants beside ``rope.RoPE`` (which also does YaRN): LongRoPE (Phi-3.5, Phi-4-mini),
and ``make_rope``, which picks the implementation for a layer's settings."""
from __future__ import annotations


import mlx.core as mx
import mlx.nn as nn

from mlxformer.models.rope_config import RopeConfig
from mlxformer.models.rope import RoPE, scale_rotated


class LongRoPE(nn.Module):
    """LongRoPE / ``su`` scaling as transformers computes it: the periods are stretched by
    ``short_factor`` while the sequence fits ``original_max_position_embeddings`` and by
    ``long_factor`` beyond, and the rotated features are multiplied by ``attention_factor``."""

    def __init__(self, dims: int, rope: RopeConfig):
        super().__init__()
        if len(rope.short_factor) != dims // 2:
            raise ValueError(f"LongRoPE needs {dims // 2} factors, got {len(rope.short_factor)}")
        self.dims = dims
        self.original = rope.original_max_position_embeddings
        self.attention_factor = rope.attention_factor
        periods = rope.theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)  # (dims/2,)
        self._short = mx.array(rope.short_factor, dtype=mx.float32) * periods
        self._long = mx.array(rope.long_factor, dtype=mx.float32) * periods
        mx.eval(self._short, self._long)  # not lazy: the engine's thread may read them first (``RoPE``)

    def __call__(self, x: mx.array, offset: int | mx.array, length: int | None = None) -> mx.array:
        """Rotate ``x`` (B, heads, T, head_dim) for positions ``offset..offset+T-1`` (``offset``
        an int or an int array ``(B,)``: each row picks its own factors). ``length``: the
        sequence length that picks the factors (default ``offset + T``; a chunked prompt passes
        its whole length, as transformers' one forward over it decides)."""
        x = scale_rotated(x, self.dims, self.attention_factor)
        if (length or 0) > self.original:
            return self._rotate(x, offset, self._long)
        if isinstance(offset, mx.array):  # both rotations, each row picking its own on the device
            long = offset + x.shape[-2] > self.original
            short_rows, long_rows = (self._rotate(x, offset, periods) for periods in (self._short, self._long))
            return mx.where(long[:, None, None, None], long_rows, short_rows)
        return self._rotate(x, offset, self._long if offset + x.shape[-2] > self.original else self._short)

    def _rotate(self, x: mx.array, offset: int | mx.array, periods: mx.array) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=periods)


def make_rope(dims: int, rope: RopeConfig, max_position_embeddings: int, traditional: bool = False) -> nn.Module:
    """The rotary embedding for ``dims`` rotated features of each head (``traditional``: in
    interleaved pairs)."""
    if rope.type == "longrope":
        return LongRoPE(dims, rope)
    return RoPE(dims, rope, max_position_embeddings, traditional)
