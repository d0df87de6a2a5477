"""Rotary position embedding on ``mx.fast.rope`` for every supported scaling type."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from mlxformer.models.config import RopeConfig


def _llama3_inv_freq(inv_freq: mx.array, rope: RopeConfig) -> mx.array:
    """Llama 3.1 frequency-dependent scaling: long wavelengths slowed by ``factor``, a smooth band between."""
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = mx.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return mx.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(inv_freq: mx.array, dims: int, rope: RopeConfig) -> mx.array:
    """YaRN as transformers computes it: frequencies interpolated by ``factor`` below a ramp
    over the dimensions that turn between ``beta_slow`` and ``beta_fast`` times in the original
    context, kept (extrapolated) above it."""

    def correction_dim(rotations: float) -> float:
        return dims * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the share of each frequency extrapolated (kept as is)
    return inv_freq / rope.factor * (1 - keep) + inv_freq * keep


def scale_rotated(x: mx.array, dims: int, factor: float) -> mx.array:
    """``x`` with its first ``dims`` (rotated) features multiplied by ``factor`` (the attention
    factor YaRN and LongRoPE apply to cos and sin)."""
    if factor == 1.0:
        return x
    rotated = x[..., :dims] * factor
    return rotated if dims == x.shape[-1] else mx.concatenate([rotated, x[..., dims:]], axis=-1)


class RoPE(nn.Module):
    """Applies non-interleaved (HF ``rotate_half``) rotary embedding to ``(B, heads, T, head_dim)``."""

    def __init__(self, dims: int, rope: RopeConfig, max_position_embeddings: int, traditional: bool = False):
        super().__init__()
        self.dims = dims
        self.traditional = traditional  # rotate interleaved pairs (DeepSeek) instead of halves
        self.config = rope
        self.max_position_embeddings = max_position_embeddings
        self.scale = 1.0 / rope.factor if rope.type == "linear" else 1.0
        # ``mx.fast.rope`` takes periods (1 / inverse frequency) through ``freqs``.
        self._periods: mx.array | None = None
        # YaRN scales cos and sin, i.e. the rotated features, by its attention factor.
        self.attention_factor = rope.attention_factor if rope.type == "yarn" else 1.0
        if rope.type in ("llama3", "freq_factors", "yarn", "proportional"):
            inv_freq = 1.0 / (rope.theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))
            if rope.type == "proportional":  # Gemma 4: later pairs unrotated (an infinite period)
                rotated = int(rope.rotated_fraction * dims // 2)
                inv_freq = mx.where(mx.arange(dims // 2) < rotated, inv_freq, 0.0) / rope.factor
            elif rope.type == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, rope)
            elif rope.type == "yarn":
                inv_freq = _yarn_inv_freq(inv_freq, dims, rope)
            else:
                inv_freq = inv_freq / mx.array(rope.freq_factors, dtype=mx.float32)
            self._periods = 1.0 / inv_freq
            # evaluated here: a lazy array from this thread's stream cannot be evaluated on
            # another (the engine's), where a graph may first read it
            mx.eval(self._periods)

    def _base(self, seq_len: int) -> float:
        """The rotary base; dynamic NTK scaling grows it once the sequence passes the trained length."""
        rope = self.config
        if rope.type != "dynamic" or seq_len <= self.max_position_embeddings:
            return rope.theta
        growth = rope.factor * seq_len / self.max_position_embeddings - (rope.factor - 1)
        return rope.theta * growth ** (self.dims / (self.dims - 2))

    def __call__(self, x: mx.array, offset: int | mx.array, length: int | None = None) -> mx.array:
        """Rotate ``x`` (B, heads, T, head_dim) for positions ``offset..offset+T-1``; ``offset``
        is an int or, for a batch of sequences at different positions, an int array ``(B,)``.

        ``length`` is the sequence length dynamic NTK scaling computes its base from (default
        ``offset + T``): a prompt prefilled in chunks passes its whole length, so every chunk is
        rotated as one forward pass over the whole prompt would rotate it (as transformers does).
        An offset array ``(1, T)`` gives each token its own position (a packed engine step)."""
        if isinstance(offset, mx.array) and offset.ndim == 2:  # (1, H, T, D) -> (T, H, 1, D), and back
            return self(x.transpose(2, 1, 0, 3), offset[0], length).transpose(2, 1, 0, 3)
        if isinstance(offset, mx.array) and self.config.type == "dynamic":
            # the dynamic base depends on each sequence's length: rotate row by row
            rows = [self(x[i : i + 1], int(o)) for i, o in enumerate(offset.tolist())]
            return mx.concatenate(rows, axis=0)
        x = scale_rotated(x, self.dims, self.attention_factor)
        if self._periods is not None:
            return mx.fast.rope(
                x, self.dims, traditional=self.traditional, base=None, scale=self.scale, offset=offset, freqs=self._periods
            )
        end = 0 if isinstance(offset, mx.array) else offset + x.shape[-2]
        base = self._base(max(end, length or 0))
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=base, scale=self.scale, offset=offset)
