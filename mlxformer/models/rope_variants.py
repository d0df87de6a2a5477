"""RoPE variants beside ``rope.RoPE``: LongRoPE (Phi-3.5, Phi-4-mini), YaRN (DeepSeek, with its
mscale), and ``make_rope``, which picks the implementation for a layer's settings."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from mlxformer.models.rope_config import RopeConfig
from mlxformer.models.rope import RoPE


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

    def __call__(self, x: mx.array, offset: int | mx.array, length: int | None = None) -> mx.array:
        """Rotate ``x`` (B, heads, T, head_dim) for positions ``offset..offset+T-1`` (``offset``
        an int or an int array ``(B,)``: each row picks its own factors). ``length``: the
        sequence length that picks the factors (default ``offset + T``; a chunked prompt passes
        its whole length, as transformers' one forward over it decides)."""
        if isinstance(offset, mx.array):
            rows = [self(x[i : i + 1], int(o)) for i, o in enumerate(offset.tolist())]
            return mx.concatenate(rows, axis=0)
        periods = self._long if max(offset + x.shape[-2], length or 0) > self.original else self._short
        if self.attention_factor != 1.0:
            rotated = x[..., : self.dims] * self.attention_factor
            x = rotated if self.dims == x.shape[-1] else mx.concatenate([rotated, x[..., self.dims :]], axis=-1)
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=periods)


def yarn_inv_freq(dims: int, rope: RopeConfig) -> mx.array:
    """transformers' ``_compute_yarn_parameters`` frequencies ``(dims / 2,)``: interpolated
    (divided by ``factor``) below the ``beta_slow`` rotations, extrapolated above ``beta_fast``,
    a linear ramp between."""
    def correction_dim(rotations: float) -> float:
        return dims * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    extrapolation = 1.0 / (rope.theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))
    keep = 1 - ramp  # the share of the extrapolated (unscaled) frequency
    return extrapolation / rope.factor * (1 - keep) + extrapolation * keep


class YarnRoPE(nn.Module):
    """YaRN: ``yarn_inv_freq`` frequencies, and the rotated features (cos and sin) multiplied
    by ``attention_factor``. ``traditional``: rotate interleaved pairs (DeepSeek's layout)."""

    def __init__(self, dims: int, rope: RopeConfig, traditional: bool = False):
        super().__init__()
        self.dims, self.traditional, self.attention_factor = dims, traditional, rope.attention_factor
        self._periods = 1.0 / yarn_inv_freq(dims, rope)

    def __call__(self, x: mx.array, offset: int | mx.array, length: int | None = None) -> mx.array:
        if self.attention_factor != 1.0:
            rotated = x[..., : self.dims] * self.attention_factor
            x = rotated if self.dims == x.shape[-1] else mx.concatenate([rotated, x[..., self.dims :]], axis=-1)
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=None, scale=1.0, offset=offset,
                            freqs=self._periods)


def make_rope(dims: int, rope: RopeConfig, max_position_embeddings: int, traditional: bool = False) -> nn.Module:
    """The rotary embedding for ``dims`` rotated features of each head (``traditional``: in
    interleaved pairs)."""
    if rope.type == "longrope":
        return LongRoPE(dims, rope)
    if rope.type == "yarn":
        return YarnRoPE(dims, rope, traditional)
    return RoPE(dims, rope, max_position_embeddings, traditional)
