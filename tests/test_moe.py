"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) on tiny random checkpoints
written by transformers' own config classes, against transformers' eager logits; engine and
speculative greedy identity. (mlx-lm interop of every family: tests/test_mlx_lm_families.py.)

80-token forwards route 160 (token, expert) pairs through the expert-sorted gather, 10-token
ones and decode steps through the unsorted one (``models.moe.SORT_THRESHOLD``).
"""

from __future__ import annotations


import mlx.core as mx
import numpy as np
import pytest

from family_checks import assert_batch_and_speculation_match_alone, chunked_then_decoded, hf_logits, tokens
from conftest import add_mlx_lm_config_keys, max_diff, write_byte_tokenizer, write_tiny_checkpoint
from mlxformer import load
from mlxformer.errors import MlxformerError
from mlxformer.formats.expert_layouts import expert_groups
from mlxformer.models.moe import SORT_THRESHOLD, SparseMoE
from mlxformer.models.row_sharding import ShardedMLP, ShardedQuantizedSwitchLinear, ShardedSwitchLinear

BOUND = 3e-4  # fp32 on both sides; measured <= 1.7e-5
CASES = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # a dense layer among sparse ones, and the gated shared expert
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, mlp_only_layers=[1]),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      head_dim=16),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2),
}


pytestmark = pytest.mark.usefixtures("cpu_module")


def write_moe(directory, model_type, **overrides):
    """A tiny checkpoint whose config.json also carries the keys mlx-lm's model classes require
    (real Qwen3-MoE configs have ``num_experts`` and ``rope_theta``; transformers 5 writes
    ``num_local_experts`` and ``rope_parameters``)."""
    directory, hf_model = write_tiny_checkpoint(directory, model_type, **{**CASES[model_type], **overrides})
    write_byte_tokenizer(directory)
    add_mlx_lm_config_keys(directory)
    return directory, hf_model


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    directory, hf_model = write_moe(tmp_path_factory.mktemp(request.param), request.param)
    model, tokenizer = load(directory, dtype=mx.float32, threads=2)  # the router and experts beside CPU shards
    tokenizer.eos_token_ids = []
    return request.param, directory, model, tokenizer, hf_model


reference = hf_logits


def test_forward_sorted_and_unsorted(case):
    name, _, model, _, hf_model = case
    assert any(isinstance(layer[layer.mlp_name], SparseMoE) for layer in model.layers)
    for length in (80, 10):
        assert (length * 2 >= SORT_THRESHOLD) == (length == 80)
        ids = tokens(length)
        assert max_diff(np.array(model(mx.array(ids[None]))[0]), reference(hf_model, ids)) <= BOUND, length


def test_experts_split_over_cpu_streams(case):
    """With 2 CPU streams every expert projection (and Qwen2-MoE's shared expert) computes a
    prompt's output rows in two shards (decode steps' few pairs on one): the same logits as one
    stream, bit for bit, float and 4-bit."""
    import mlx.nn as nn

    _, directory, model, _, _ = case
    blocks = [layer[layer.mlp_name] for layer in model.layers if isinstance(layer[layer.mlp_name], SparseMoE)]
    assert all(isinstance(b.switch_mlp[p], ShardedSwitchLinear) for b in blocks for p in ("gate_proj", "up_proj", "down_proj"))
    assert all(isinstance(b.shared_expert, ShardedMLP) for b in blocks if "shared_expert" in b)
    alone, _ = load(directory, dtype=mx.float32, threads=1)
    inputs = [mx.array(tokens(80)[None]), mx.array(tokens(3)[None])]  # the sorted gather, and the unsorted one
    assert all(mx.array_equal(model(ids), alone(ids)) for ids in inputs)
    split, alone = (load(directory, dtype=mx.float32, threads=t)[0] for t in (2, 1))  # fresh: the fixture stays float
    for m in (split, alone):
        nn.quantize(m, group_size=32, bits=4,
                    class_predicate=lambda _, layer: hasattr(layer, "to_quantized") and layer.weight.shape[-1] % 32 == 0)
    experts = [layer[layer.mlp_name].switch_mlp for layer in split.layers if isinstance(layer[layer.mlp_name], SparseMoE)]
    assert all(isinstance(e.down_proj, ShardedQuantizedSwitchLinear) for e in experts)
    assert all(mx.array_equal(split(ids), alone(ids)) for ids in inputs)


def test_chunked_prefill_then_decode(case):
    name, _, model, _, hf_model = case
    ids = tokens(40)
    assert max_diff(chunked_then_decoded(model, ids, 20), reference(hf_model, ids)[19:]) <= BOUND


def test_engine_batch_and_speculation_match_alone(case):
    name, _, model, tokenizer, _ = case
    assert_batch_and_speculation_match_alone(model, tokenizer)


def test_missing_expert_is_named(tmp_path):
    names = [f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in (0, 1, 3)]
    with pytest.raises(MlxformerError, match=r"model.layers.0.mlp.experts: .*missing or extra \[2\]"):
        expert_groups(names, 4)
    directory, _ = write_moe(tmp_path, "qwen3_moe")  # the same through load, from the file
    from safetensors.numpy import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(MlxformerError, match=r"model.layers.1.mlp.experts: .*\[5\]"):
        load(directory)


def test_tensor_parallel_refuses_experts(case):
    from mlxformer.distributed.tensor import check_divisible

    with pytest.raises(MlxformerError, match="--parallel pipeline"):
        check_divisible(case[2].args, 2)
