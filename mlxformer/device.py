"""Facts about where MLX runs: the backend-dependent policies (compute dtype, CPU streams,
prefill chunk size) all ask these."""

from __future__ import annotations

import os

import mlx.core as mx


def on_cpu() -> bool:
    """Whether MLX's default device is the CPU."""
    return mx.default_device().type == mx.DeviceType.cpu


def available_cores() -> int:
    """Cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
