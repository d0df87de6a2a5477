"""Which feed-forward block a layer gets: ``ModelArgs.mlp_type``'s row of ``MLP_TYPES``.

Each row is a builder ``(args, layer_index) -> module``; a mixture-of-experts builder may
return the dense MLP for some layers (``mlp_only_layers``, ``decoder_sparse_step``).
"""

from __future__ import annotations

from typing import Callable

import mlx.nn as nn

from mlxformer.models.config import ModelArgs
from mlxformer.models.mlp import dense_mlp
from mlxformer.models.moe import moe_mlp
from mlxformer.models.moe_gpt_oss import gpt_oss_mlp

MLP_TYPES: dict[str, Callable[[ModelArgs, int], nn.Module]] = {
    "dense": dense_mlp,  # gated (SwiGLU/GeGLU, fused or not) or plain (GPT-2)
    "moe": moe_mlp,  # routed experts: softmax or DeepSeek's grouped router, shared experts
    "moe_topk_softmax": gpt_oss_mlp,  # gpt-oss: softmax over the top-k logits, biased experts
}


def make_mlp(args: ModelArgs, layer_index: int) -> nn.Module:
    """The feed-forward block of layer ``layer_index``."""
    return MLP_TYPES[args.mlp_type](args, layer_index)
