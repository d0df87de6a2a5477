"""LoRA/DoRA adapters: read mlx-lm's and PEFT's (``files``), carried by a model and chosen per
row (``layers``), or fused into its weights (``fuse_adapter``)."""

from mlxformer.adapters.files import Adapter, LowRank, read_adapter
from mlxformer.adapters.layers import AdapterBank, attach_adapters, fuse_adapter

__all__ = ["Adapter", "AdapterBank", "LowRank", "attach_adapters", "fuse_adapter", "read_adapter"]
