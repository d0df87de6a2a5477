"""LoRA/DoRA adapters.

- ``files.py``: mlx-lm's and PEFT's adapter dirs read and checked into one ``Adapter``.
- ``layers.py``: adapters carried beside any projection of a loaded model and chosen per row
  in one batched step (``attach_adapters``), or fused into the weights (``fused_weight``,
  ``convert --adapter``)."""

from mlxformer.adapters.files import Adapter, LowRank, read_adapter
from mlxformer.adapters.layers import AdapterBank, attach_adapters, fused_weight

__all__ = ["Adapter", "AdapterBank", "LowRank", "attach_adapters", "fused_weight", "read_adapter"]
