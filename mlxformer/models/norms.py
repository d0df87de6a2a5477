"""RMSNorm with Gemma's ``(1 + weight)`` offset, LayerNorm (GPT-2), and where each layout puts
a layer's norms."""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

if TYPE_CHECKING:
    from mlxformer.models.config import ModelArgs

# Per layout, the norm (HF name) applied to: the attention input, the attention output, the
# MLP input, the MLP output (None: no norm there).
NORM_LAYOUTS: dict[str, tuple[str | None, str | None, str | None, str | None]] = {
    "pre": ("input_layernorm", None, "post_attention_layernorm", None),  # Llama
    "sandwich": ("input_layernorm", "post_attention_layernorm",  # Gemma 2/3
                 "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),  # OLMo 2
}


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` scaling by ``offset + weight`` (Gemma stores the weight minus one)."""

    def __init__(self, dims: int, eps: float = 1e-5, offset: float = 0.0):
        super().__init__(dims, eps=eps)
        self.offset = offset

    def __call__(self, x: mx.array) -> mx.array:
        if not self.offset:
            return super().__call__(x)
        # ``offset + weight`` and the product in float32, as transformers' Gemma norms compute
        # them: in bfloat16, ``1 + weight`` keeps 8 bits (a 0.4% error on every scale)
        scale = self.offset + self.weight.astype(mx.float32)
        return mx.fast.rms_norm(x, scale, self.eps).astype(x.dtype)


def make_norm(args: "ModelArgs", dims: int) -> nn.Module:
    """The decoder's norm of ``dims`` features: RMSNorm (``norm_offset + weight``), or, for
    ``norm_type="layer"``, LayerNorm with a weight and a bias (GPT-2)."""
    if args.norm_type == "layer":
        return nn.LayerNorm(dims, eps=args.rms_norm_eps)
    return RMSNorm(dims, eps=args.rms_norm_eps, offset=args.norm_offset)
