"""LoRA/DoRA adapters: read mlx-lm's and PEFT's (``files``), carried by a model and chosen per
row (``layers``), or fused into its weights (``fused_weight``, ``convert --adapter``)."""

from mlxformer.adapters.files import Adapter, LowRank, read_adapter
from mlxformer.adapters.layers import AdapterBank, attach_adapters, fused_weight

__all__ = ["Adapter", "AdapterBank", "LowRank", "attach_adapters", "fused_weight", "read_adapter"]
