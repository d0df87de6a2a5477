"""Hostile configs: every size is bounded before anything is built from it, with one line
naming the key (``num_local_experts: 30000000`` used to take 9.5 s and 3 GB before its error)."""

from __future__ import annotations

import json
import time

import pytest

from conftest import write_tiny_checkpoint
from mlxformer import load
from mlxformer.errors import MlxformerError
from mlxformer.models.config import ModelArgs

BASE = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)
MOE = dict(BASE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
HUGE = 30_000_000

HOSTILE = [
    (dict(MOE, num_local_experts=HUGE), "num_local_experts"),
    (dict(MOE, model_type="qwen3_moe", num_experts=HUGE, moe_intermediate_size=32), "num_experts"),
    (dict(MOE, model_type="qwen3_moe", num_experts=8, moe_intermediate_size=1 << 30), "moe_intermediate_size"),
    (dict(BASE, num_hidden_layers=1 << 30), "num_hidden_layers"),
    (dict(BASE, model_type="smollm3", num_hidden_layers=1 << 30), "num_hidden_layers"),
    (dict(BASE, model_type="olmo3", layer_types=["full_attention"] * 3), "layer_types"),
    (dict(BASE, model_type="olmo3", layer_types=["full_attention"] * HUGE), "layer_types"),
    (dict(BASE, model_type="smollm3", no_rope_layers=[1] * 7), "no_rope_layers"),
    (dict(BASE, head_dim=1 << 20), "head_dim"),
    (dict(BASE, vocab_size=1 << 30), "vocab_size"),
    (dict(BASE, intermediate_size=1 << 30), "intermediate_size"),
    (dict(BASE, hidden_size=1 << 30), "hidden_size"),
    (dict(BASE, num_attention_heads=1 << 20), "num_attention_heads"),
    (dict(BASE, num_key_value_heads=-2), "num_key_value_heads"),
    (dict(BASE, kv_lora_rank=1 << 30), "kv_lora_rank"),
    (dict(BASE, q_lora_rank="1024"), "q_lora_rank"),
    (dict(BASE, sliding_window=1 << 40), "sliding_window"),
    (dict(BASE, num_experts_per_tok=True), "num_experts_per_tok"),
    (dict(BASE, rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * HUGE, "long_factor": [1.0]}),
     "short_factor"),
    # numbers that made NaN logits or a Python error naming nothing
    (dict(BASE, rope_theta=0), "rope_theta"),
    (dict(BASE, rope_theta=float("nan")), "rope_theta"),
    (dict(BASE, rope_theta=[1]), "rope_theta"),
    (dict(BASE, rms_norm_eps=float("nan")), "rms_norm_eps"),
    (dict(BASE, rms_norm_eps=-1e-6), "rms_norm_eps"),
    (dict(BASE, rope_scaling={"rope_type": "linear", "factor": 0}), "rope factor"),
    (dict(BASE, rope_parameters={"rope_type": "default", "rope_theta": -5.0}), "rope rope_theta"),
    # an activation the decoder does not have (it was read as SiLU, and convert wrote silu)
    (dict(BASE, hidden_act="relu"), "unsupported activation 'relu'"),
    (dict(BASE, model_type="qwen3", hidden_act="gelu"), "unsupported activation 'gelu'"),
]


@pytest.mark.parametrize("config,key", HOSTILE, ids=[f"{k}-{i}" for i, (_, k) in enumerate(HOSTILE)])
def test_hostile_size_fails_fast_naming_the_key(config, key):
    start = time.perf_counter()
    with pytest.raises(MlxformerError, match=key) as error:
        ModelArgs.from_dict(config)
    assert time.perf_counter() - start < 0.5
    assert "\n" not in str(error.value)


def test_sane_configs_still_load():
    assert ModelArgs.from_dict(MOE).num_experts == 4
    olmo3 = ModelArgs.from_dict(dict(BASE, model_type="olmo3", sliding_window=8, num_hidden_layers=4))
    assert olmo3.layer_types == ("sliding",) * 3 + ("full",)


def test_a_dense_mlp_needs_its_width():
    """``intermediate_size`` may be absent only where no layer has a dense MLP (issue 44)."""
    from mlxformer.models.decoder import Model

    dense = {k: v for k, v in BASE.items() if k != "intermediate_size"}
    with pytest.raises(MlxformerError, match="intermediate_size must be a positive integer"):
        Model(ModelArgs.from_dict(dense))
    experts = dict(dense, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    assert ModelArgs.from_dict(experts).intermediate_size == 0
    with pytest.raises(MlxformerError, match="intermediate_size"):  # its dense layers (mlp_only_layers) need it
        Model(ModelArgs.from_dict(dict(experts, mlp_only_layers=[0])))
    assert Model(ModelArgs.from_dict(experts)).args.num_experts == 4


def test_hostile_checkpoint_fails_before_loading(tmp_path):
    """The issue's case end to end: a real Mixtral checkpoint whose config claims 30M experts."""
    write_tiny_checkpoint(tmp_path, "mixtral", num_local_experts=3, num_experts_per_tok=2)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_local_experts": HUGE}))
    start = time.perf_counter()
    with pytest.raises(MlxformerError, match="num_local_experts must be an integer in 0..16384, not 30000000"):
        load(tmp_path)
    assert time.perf_counter() - start < 1.0
