"""The device plan: the load-time policies that depend on the device a model runs on, as one value.

``DevicePlan`` names a device kind (``"gpu"`` or ``"cpu"``) and answers for it: the compute
dtype (``dtype_policy.apply_dtype_policy`` for that device: 16-bit on a GPU, never float16 for a
model that overflows it), the CPU streams a projection is split over, and the prefill chunk.
It is normally the default device's (``DevicePlan.current()``), and can be forced
(``load(plan=...)``, ``--device-plan``): the GPU plan then runs on the CPU, so the choices a
GPU makes are tested on a machine without one.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlxformer.device import available_cores
from mlxformer.errors import MlxformerError

KINDS = ("gpu", "cpu")
MAX_DEFAULT_THREADS = 4  # CPU streams per projection by default
# Prompt tokens per prefill chunk. On the CPU smaller chunks are as fast or faster
# (cache-friendly matmuls) and cut the activations' peak memory (measured on SmolLM2, 256
# tokens: 128-token chunks +19 MB over the weights vs +26 MB at 256, same tok/s); a GPU
# wants large chunks to fill the device.
PREFILL_STEP = {"gpu": 512, "cpu": 128}


@dataclass(frozen=True)
class DevicePlan:
    """The policies for one device kind (``"gpu"`` or ``"cpu"``)."""

    kind: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise MlxformerError(f"the device plan must be one of {', '.join(KINDS)} (got {self.kind!r})")

    @classmethod
    def current(cls) -> "DevicePlan":
        """The plan of MLX's default device."""
        return cls("cpu" if mx.default_device().type == mx.DeviceType.cpu else "gpu")

    @classmethod
    def named(cls, kind: str | None) -> "DevicePlan":
        """The plan called ``kind``, or the default device's for ``None``."""
        return cls.current() if kind is None else cls(kind)

    @property
    def device(self) -> mx.DeviceType:
        return mx.DeviceType.gpu if self.kind == "gpu" else mx.DeviceType.cpu

    @property
    def threads(self) -> int:
        """CPU streams each projection is split over by default: the usable cores (at most 4)
        on the CPU, else 1 (not split)."""
        return min(available_cores(), MAX_DEFAULT_THREADS) if self.kind == "cpu" else 1

    @property
    def prefill_step(self) -> int:
        """Prompt tokens per prefill chunk."""
        return PREFILL_STEP[self.kind]


def wire_memory() -> int | None:
    """On Metal, wire the recommended working set (as mlx-lm does) so that the weights are not
    paged out between steps; the limit set, or None without Metal."""
    if not mx.metal.is_available():
        return None
    limit = int(mx.metal.device_info()["max_recommended_working_set_size"])
    mx.set_wired_limit(limit)
    return limit
