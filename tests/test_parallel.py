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

from conftest import cpu_default_device, write_tiny_checkpoint
from mlxformer.device import available_cores
from mlxformer.loader import build_model, read_checkpoint
from mlxformer.models.row_sharding import PROJECTIONS, RowSharded, apply_thread_policy, default_threads, row_bounds


@pytest.fixture(scope="module", autouse=True)
def cpu_device():
    """Row sharding is a CPU policy: pin the CPU device whatever the machine's default."""
    with cpu_default_device():
        yield


def test_default_threads_on_the_cpu_device():
    assert default_threads() == min(available_cores(), 4) >= 1


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


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny llama checkpoint with tied and one with untied embeddings."""
    return {tied: write_tiny_checkpoint(tmp_path_factory.mktemp(f"tied{tied}"), "llama", tie_word_embeddings=tied)[0]
            for tied in (True, False)}


def tiny_model(checkpoints, tied: bool, bits: int | None):
    config, weights, _ = read_checkpoint(checkpoints[tied])
    model = build_model(config, weights)
    model.set_dtype(mx.float32)
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("bits", [None, 4, 8])
def test_sharded_model_matches_plain(checkpoints, tied, bits):
    model = tiny_model(checkpoints, tied, bits)
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


def test_quantized_sharded_layer_keeps_its_type(checkpoints):
    """``isinstance`` checks (the dtype policy, ``is_quantized``) see the original layer type."""
    model = tiny_model(checkpoints, tied=True, bits=4)
    apply_thread_policy(model, 2)
    assert isinstance(model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    assert model.layers[0].mlp.down_proj.bits == 4
    apply_thread_policy(model, 3)  # idempotent: already sharded layers are left alone
    assert model.layers[0].mlp.down_proj.parts == 2


def sharded_modules(model) -> list[str]:
    """Paths of every layer that should be row-sharded: the projections and the vocabulary projection."""
    paths = [f"model.layers.{i}.{owner}.{name}" for i, layer in enumerate(model.layers)
             for owner in ("self_attn", "mlp") for name in PROJECTIONS if name in layer[owner]]
    return paths + ["model.embed_tokens" if model.args.tie_word_embeddings else "lm_head"]


def assert_sharded(model) -> None:
    modules = dict(model.named_modules())
    assert all(isinstance(modules[path], RowSharded) and modules[path].parts == 2 for path in sharded_modules(model))


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("change", ["set_dtype", "load_weights", "quantize"])
def test_sharding_survives_weight_changes_after_load(checkpoints, tied, change):
    """After ``set_dtype``, ``load_weights`` (new values) or ``nn.quantize`` on the sharded model,
    the layers are still sharded and the logits (value and dtype) are those of an unsharded
    model given the same change."""
    sharded, plain = tiny_model(checkpoints, tied, None), tiny_model(checkpoints, tied, None)
    apply_thread_policy(sharded, 2)
    ids = mx.array(np.random.default_rng(1).integers(0, 256, size=(1, 24)))
    mx.eval(sharded(ids))  # used once before the change
    for model in (sharded, plain):
        if change == "set_dtype":
            model.set_dtype(mx.bfloat16)
        elif change == "load_weights":
            rng = np.random.default_rng(7)
            model.load_weights([(k, mx.array(rng.normal(0, 0.2, v.shape).astype(np.float32)))
                                for k, v in tree_flatten(model.parameters())])
        else:
            nn.quantize(model, group_size=32, bits=4)
    got, ref = sharded(ids), plain(ids)
    expected_dtype = mx.bfloat16 if change == "set_dtype" else mx.float32
    assert got.dtype == ref.dtype == expected_dtype
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(ref.astype(mx.float32)),
                               rtol=0, atol=1e-2 if change == "set_dtype" else 1e-5)
    assert dict(tree_flatten(sharded.parameters())).keys() == dict(tree_flatten(plain.parameters())).keys()
    assert_sharded(sharded)
    if change == "quantize":
        assert all(isinstance(dict(sharded.named_modules())[p], (nn.QuantizedLinear, nn.QuantizedEmbedding))
                   for p in sharded_modules(sharded))
