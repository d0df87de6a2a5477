"""The multi-token-prediction (MTP) head Qwen3.5/3.6 and Qwen3-Next ship beside the decoder.

Checkpoint names (``mtp.`` stripped): ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``fc``
(``(hidden, 2 * hidden)``), ``layers.N.*`` (a full-attention decoder layer: gated attention,
and the MoE block in the MoE variants) and ``norm``; the embedding and the output projection
are the main model's. For position ``p`` it takes the main model's final hidden state ``h_p``
(after its final norm) and the embedding of the next token ``x_{p+1}``, and predicts
``x_{p+2}``: ``norm(layer(fc([norm_e(emb), norm_h(h)])))``, then the main model's ``lm_head``
(the order and the norms as vLLM's ``qwen3_next_mtp``). Its output, already normed, is also
the ``h`` of the next chained step.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn

from mlxformer.cache.protocol import Cache
from mlxformer.errors import MlxformerError
from mlxformer.models.config import ModelArgs
from mlxformer.models.decoder import DecoderLayer
from mlxformer.models.norms import RMSNorm

__all__ = ["MTPHead", "mtp_args"]


def mtp_args(args: ModelArgs, num_layers: int) -> ModelArgs:
    """The main model's args for ``num_layers`` full-attention MTP layers."""
    if num_layers != 1:  # vLLM cycles several layers over the draft steps; no checkpoint ships more than one
        raise MlxformerError(f"the checkpoint has {num_layers} MTP layers; only one is supported")
    return dataclasses.replace(args, num_hidden_layers=num_layers, layer_types=("full",) * num_layers,
                               rope_layers=(), mtp_layers=0)


class MTPHead(nn.Module):
    """``pre_fc_norm_embedding``/``pre_fc_norm_hidden``, ``fc``, ``layers`` and ``norm`` (the
    checkpoint's ``mtp.*`` names); see the module docstring."""

    def __init__(self, args: ModelArgs, num_layers: int = 1):
        super().__init__()
        self.args = mtp_args(args, num_layers)
        hidden, eps, offset = args.hidden_size, args.rms_norm_eps, args.norm_offset
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps=eps, offset=offset)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps=eps, offset=offset)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = [DecoderLayer(self.args, i) for i in range(num_layers)]
        self.norm = RMSNorm(hidden, eps=eps, offset=offset)

    @property
    def cache_layers(self) -> list[DecoderLayer]:
        """The layers with caches (``make_cache``'s): all of them."""
        return self.layers

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: Sequence[Cache]) -> mx.array:
        """Embeddings of tokens ``x_{p+1}`` and the hidden states ``h_p`` ``(B, L, hidden)`` of
        positions ``p`` in, the normed MTP hidden states ``(B, L, hidden)`` out (logits of
        ``x_{p+2}`` through the main model's ``logits``)."""
        # (B, L, hidden) x 2 -> (B, L, 2 * hidden): embedding first, as the checkpoints are trained
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], axis=-1))
        query_len = x.shape[1]
        for layer, layer_cache in zip(self.layers, cache):
            x = layer(x, layer_cache.make_mask(query_len, None), layer_cache)
        return self.norm(x)
