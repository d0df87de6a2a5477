"""A GGUF's ``rope_freqs`` tensor as a ``rope_scaling`` config entry.

llama.cpp's converter stores Llama 3.1/3.2's ``llama3`` rope scaling as one period factor per
rotary frequency. Those factors depend on ``original_max_position_embeddings`` (``L``) and
the low/high frequency factors only through ``L / low`` and ``L / high``, so the parameters
written are the equivalent ones with ``low_freq_factor`` 1 (Llama 3.1/3.2's own values come
back exactly: 8192, 1, 4); they are recovered from the smooth band and checked by recomputing
every factor. With no factor inside the band (small head sizes: every factor is 1 or ``factor``)
any band that falls between the two groups' wavelengths reproduces them, and one is chosen.
Factors that are not llama3's stay ``freq_factors``, which only mlxformer reads.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# A recomputed factor must match the stored float32 one this closely.
_RTOL = 1e-5
# Llama 3.1/3.2's values, tried when the factors have no smooth band to fit.
_LLAMA3_DEFAULT = (8192, 4.0)


def llama3_factors(inv_freq: np.ndarray, factor: float, low: float, high: float, original: float) -> np.ndarray:
    """The period factor of each frequency under llama3 scaling (transformers' formula)."""
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, medium))


def _fit(inv_freq: np.ndarray, factors: np.ndarray, factor: float) -> tuple[float, float] | None:
    """``(L, high)`` with low = 1 from the smooth band, where ``smooth`` is linear in the frequency."""
    band = (factors > 1 + _RTOL) & (factors < factor * (1 - _RTOL))
    if band.sum() < 2:
        return None
    smooth = (1 / factors[band] - 1 / factor) / (1 - 1 / factor)  # 1/f = (1 - s)/factor + s
    slope, intercept = np.polyfit(inv_freq[band] / (2 * math.pi), smooth, 1)  # s = (L*freq/2pi - 1)/(high - 1)
    if intercept >= 0 or slope <= 0:
        return None
    high = 1 - 1 / intercept
    return slope * (high - 1), high


def _fit_gap(inv_freq: np.ndarray, factors: np.ndarray, factor: float) -> tuple[float, float] | None:
    """``(L, high)`` with low = 1 whose smooth band ``[L / high, L]`` holds no frequency, when every
    factor is 1 or ``factor``: L at (or just below) the shortest slowed wavelength, ``L / high``
    halfway down to the longest kept one."""
    kept, slowed = np.isclose(factors, 1.0, rtol=_RTOL), np.isclose(factors, factor, rtol=_RTOL)
    if not (kept | slowed).all() or not slowed.any():
        return None
    wavelen = 2 * math.pi / inv_freq
    longest_kept = float(wavelen[kept].max()) if kept.any() else 0.0
    original = math.floor(float(wavelen[slowed].min()))  # an integer no longer than every slowed wavelength
    if original <= longest_kept or original < 1:
        return None
    return float(original), original / ((original + longest_kept) / 2)


def rope_scaling_from_factors(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """``rope_scaling`` for ``rope_freqs`` factors: ``llama3`` parameters when they reproduce
    every factor, else ``freq_factors``."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    stored = factors.astype(np.float64)
    factor = float(stored.max())
    if factor > 1:
        fits = (_fit(inv_freq, stored, factor), _LLAMA3_DEFAULT, _fit_gap(inv_freq, stored, factor))
        for original, high in filter(None, fits):
            original, high = int(round(original)), round(high, 6)
            if high > 1 and np.allclose(llama3_factors(inv_freq, factor, 1.0, high, original), stored, rtol=_RTOL):
                return {"rope_type": "llama3", "factor": float(np.float32(factor)), "low_freq_factor": 1.0,
                        "high_freq_factor": high, "original_max_position_embeddings": original}
    return {"rope_type": "freq_factors", "factor": 1.0, "freq_factors": [float(f) for f in factors]}
