"""Projections split over CPU streams: same outputs, same parameters, no extra memory.

The transformers-parity tests run every tiny family with and without sharding
(test_parity_tiny) and the real quantized GGUF sharded (conftest ``smollm``); these tests
cover what parity cannot see: the parameter tree, memory, and quantized tiny layers.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import write_tiny_checkpoint
from mlxformer.loader import build_model, read_checkpoint
from mlxformer.models.row_sharding import PROJECTIONS, RowSharded, apply_thread_policy, row_bounds


@pytest.mark.parametrize("rows", [2, 5, 100, 192, 576, 1536, 49152])
@pytest.mark.parametrize("parts", [2, 3, 4])
def test_row_bounds_partition_the_rows(rows, parts):
    bounds = row_bounds(rows, parts)
    assert bounds[0][0] == 0 and bounds[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, no overlap
    assert all(stop > start for start, stop in bounds) and len(bounds) <= parts
    sizes = [stop - start for start, stop in bounds]
    if rows >= 8 * parts:
        assert len(bounds) == parts
        assert all(stop % 8 == 0 for _, stop in bounds[:-1])  # SIMD-friendly cuts
        assert sizes[0] >= max(sizes[1:])  # the calling stream's shard is the largest
        assert max(sizes) - min(sizes) <= rows // parts // 2 + 8  # and none is starved


def tiny_model(tmp_path, tied: bool, bits: int | None):
    directory, _ = write_tiny_checkpoint(tmp_path, "llama", tie_word_embeddings=tied)
    config, weights, _ = read_checkpoint(directory)
    model = build_model(config, weights)
    model.set_dtype(mx.float32)
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("bits", [None, 4, 8])
def test_sharded_model_matches_plain(tmp_path, tied, bits):
    model = tiny_model(tmp_path, tied, bits)
    ids = mx.array(np.random.default_rng(0).integers(0, 256, size=(1, 24)))
    plain_logits = model(ids)
    plain_params = dict(tree_flatten(model.parameters()))
    mx.eval(plain_logits)
    memory_before = mx.get_active_memory()

    apply_thread_policy(model, 2)
    mx.eval(model.parameters())
    # the shards are views of the same buffers: no new weight memory
    assert mx.get_active_memory() - memory_before < 4096
    for layer in model.layers:
        for owner in (layer.self_attn, layer.mlp):
            assert all(isinstance(owner[name], RowSharded) for name in PROJECTIONS if name in owner)
    # parameter names and values are those of the checkpoint
    params = dict(tree_flatten(model.parameters()))
    assert params.keys() == plain_params.keys()
    assert all(mx.array_equal(params[k], plain_params[k]).item() for k in params)
    # each output row is the same dot product, just computed on another stream
    np.testing.assert_allclose(np.array(model(ids)), np.array(plain_logits), rtol=0, atol=1e-5)


def test_quantized_sharded_layer_keeps_its_type(tmp_path):
    """``isinstance`` checks (the dtype policy, ``is_quantized``) see the original layer type."""
    model = tiny_model(tmp_path, tied=True, bits=4)
    apply_thread_policy(model, 2)
    assert isinstance(model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    assert model.layers[0].mlp.down_proj.bits == 4
    apply_thread_policy(model, 2)  # idempotent: already sharded layers are left alone
    assert len(model.layers[0].mlp.down_proj._shards) == 2
