"""Host reads of mixture-of-experts models split over CPU streams (issue 32), on tiny random
Qwen3-MoE and gpt-oss checkpoints written by transformers, top-8 of 16 experts so that a decode
step of 8 or 16 rows sorts its 64-128 (token, expert) pairs: an engine decode step reads once at
batch 1, 8 and 16 (the experts gather; before: three reads of the counts per MoE block); a
prompt's counted experts read the counts once per block, and give the gather's and
transformers' logits; the GPU plan's sorted gather never reads.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from conftest import max_diff
from family_checks import hf_logits, tokens
from test_gpt_oss import write_gpt_oss
from test_moe import write_moe
from test_syncs import counting_syncs
from mlxformer import load, stream_generate
from mlxformer.engine import Engine, GenerationRequest
from mlxformer.models import expert_counts
from mlxformer.models.device_plan import DevicePlan
from mlxformer.models.moe import SORT_THRESHOLD, SparseMoE
from mlxformer.models.row_sharding import ShardedSwitchGLU

pytestmark = pytest.mark.usefixtures("cpu_module")

BOUND = 3e-4  # fp32 on both sides, as tests/test_moe.py
TOP_8_OF_16 = {"qwen3_moe": dict(num_experts=16, num_experts_per_tok=8),
               "gpt_oss": dict(num_local_experts=16, num_experts_per_tok=8)}
PROMPT = 80  # tokens: 640 pairs, 40 per expert (counted, float and 4-bit), below gpt-oss' 256 positions


@pytest.fixture(scope="module", params=list(TOP_8_OF_16))
def family(request, tmp_path_factory):
    """(name, directory, model on 2 CPU streams, tokenizer, transformers' model)."""
    directory = tmp_path_factory.mktemp(request.param)
    write = write_gpt_oss if request.param == "gpt_oss" else (lambda d, **o: write_moe(d, "qwen3_moe", **o))
    directory, hf_model = write(directory, **TOP_8_OF_16[request.param])
    model, tokenizer = load(directory, dtype=mx.float32, threads=2)
    tokenizer.eos_token_ids = []
    return request.param, directory, model, tokenizer, hf_model


def moe_blocks(model) -> int:
    return sum(isinstance(layer[layer.mlp_name], SparseMoE) for layer in model.layers)


def test_prompt_counts_once_per_block(family, monkeypatch):
    """A prompt's expert-sorted pairs are counted once per MoE block (gate, up and down share
    the count) and give transformers' logits and the gather's (the same model with counting
    off); a decode-sized forward and a decode step's rows (one token each) never read."""
    _, _, model, _, hf_model = family
    blocks = [layer[layer.mlp_name] for layer in model.layers]
    assert all(isinstance(b[b.experts_name], ShardedSwitchGLU) for b in blocks)
    ids = tokens(PROMPT)
    with counting_syncs(monkeypatch) as syncs:
        counted = model(mx.array(ids[None]))[0]
    assert syncs == ["tolist"] * moe_blocks(model), syncs
    assert max_diff(np.array(counted), hf_logits(hf_model, ids)) <= BOUND
    monkeypatch.setattr(expert_counts, "COUNTED_PAIRS_PER_EXPERT", {False: float("inf"), True: float("inf")})
    with counting_syncs(monkeypatch) as syncs:
        gathered = model(mx.array(ids[None]))[0]
    assert syncs == [] and mx.allclose(counted, gathered, atol=1e-5, rtol=1e-5)
    k = model.args.num_experts_per_tok
    rows = mx.array(ids[:16, None])  # (16, 1): a decode step's shape, 128 sorted pairs
    assert 16 * k >= SORT_THRESHOLD and expert_counts.counting_pays(16 * k, 16, False, decoding=False)  # as a prompt: counted
    with counting_syncs(monkeypatch) as syncs:
        mx.eval(model(rows), model(mx.array(ids[None, :3])))  # and 3 tokens: 24 unsorted pairs
    assert syncs == ["eval"], syncs


def test_quantized_prompt_counts_once_per_block(family, monkeypatch):
    """4-bit experts (each expert's rows dequantized for its product) count once per block too,
    and give the gather's logits."""
    import mlx.nn as nn

    _, directory, _, _, _ = family
    model, _ = load(directory, dtype=mx.float32, threads=2)
    nn.quantize(model, group_size=32, bits=4,
                class_predicate=lambda _, layer: hasattr(layer, "to_quantized") and layer.weight.shape[-1] % 32 == 0)
    ids = mx.array(tokens(PROMPT)[None])
    with counting_syncs(monkeypatch) as syncs:
        counted = model(ids)
    assert syncs == ["tolist"] * moe_blocks(model), syncs
    monkeypatch.setattr(expert_counts, "COUNTED_PAIRS_PER_EXPERT", {False: float("inf"), True: float("inf")})
    assert mx.allclose(counted, model(ids), atol=1e-4, rtol=1e-4)


def test_gpu_plan_sorted_gather_never_reads(family, monkeypatch):
    """The GPU plan (forced on the CPU: no CPU streams) sorts a prompt's pairs for ``gather_mm``
    without a host read, with the split model's logits."""
    _, directory, model, _, _ = family
    gpu_plan, _ = load(directory, dtype=mx.float32, plan=DevicePlan("gpu"))
    ids = mx.array(tokens(PROMPT)[None])
    with counting_syncs(monkeypatch) as syncs:
        logits = gpu_plan(ids)
    assert syncs == [] and mx.allclose(logits, model(ids), atol=1e-5, rtol=1e-5)


PROMPTS = [f"request {i}: {'abcdefgh'[i % 8] * (1 + i % 3)}" for i in range(16)]


@pytest.mark.parametrize("batch", [1, 8, 16])
def test_one_read_per_engine_decode_step(family, batch, monkeypatch):
    """Every engine step that only decodes (``batch`` rows) reads once (the tokens, overlapped:
    tests/test_syncs.py), the experts gathering its 8-128 pairs; the tokens equal each prompt
    decoded alone."""
    _, _, model, tokenizer, _ = family
    prompts = PROMPTS[:batch]
    expected = [[r.token for r in stream_generate(model, tokenizer, p, 12)] for p in prompts]
    engine = Engine(model, tokenizer, max_batch=batch, prefix_cache_bytes=0)
    planned, reads = [], []  # the steps _run ran in one engine step; each decode-only step's reads
    real_run, real_step, real_retire = engine._run, engine.step, engine.departures.retire
    monkeypatch.setattr(engine, "_run", lambda step: (planned.append(step), real_run(step))[1])

    def retire(sequence) -> None:  # a finished row's cache offered for reuse: gpt-oss' window
        start = len(syncs)         # positions are read there (cache/rotating.py), not in the step
        real_retire(sequence)
        del syncs[start:]

    def step() -> None:
        start = len(syncs)
        planned.clear()
        real_step()
        if len(planned) == 1 and not planned[0].prefill and len(planned[0].decode) == batch:
            reads.append(syncs[start:])

    with counting_syncs(monkeypatch) as syncs:
        monkeypatch.setattr(engine, "step", step)
        monkeypatch.setattr(engine.departures, "retire", retire)
        with engine:
            with engine._wake:  # together: the idle loop sees them in one step
                handles = [engine.submit(GenerationRequest(tokenizer.encode(p), max_tokens=12)) for p in prompts]
            events = [list(h) for h in handles]
    assert [[e.token for e in ev] for ev in events] == expected
    assert len(reads) >= 5 and reads[0] in ([], ["tolist"]) and all(r == ["tolist"] for r in reads[1:]), str(reads)
