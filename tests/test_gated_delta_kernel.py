"""The Metal kernel of the recurrent gated delta rule (``models/gated_delta_kernel.py``) against
the MLX-ops form (``recurrent_delta_rule``, itself tested against transformers in
test_hybrid.py): the same outputs and per-token states on random inputs, at the tiny test sizes
and at Qwen3.5's (128-wide heads), one token (decode) and a few (a speculation round). It runs
where Metal exists; elsewhere the ops form is the one used, which the last test checks."""

from __future__ import annotations

import mlx.core as mx
import pytest

from conftest import cpu_default_device
from mlxformer.models import gated_delta
from mlxformer.models.gated_delta import delta_rule, l2_normalize, recurrent_delta_rule
from mlxformer.models.gated_delta_kernel import metal_recurrent_delta_rule, uses_kernel


def inputs(B: int, H: int, L: int, Dk: int, Dv: int, seed: int = 0) -> list[mx.array]:
    keys = mx.random.split(mx.random.key(seed), 6)
    q = l2_normalize(mx.random.normal((B, H, L, Dk), key=keys[0])) * Dk**-0.5
    k = l2_normalize(mx.random.normal((B, H, L, Dk), key=keys[1]))
    v = mx.random.normal((B, H, L, Dv), key=keys[2])
    g = -mx.random.uniform(0.01, 2.0, (B, H, L), key=keys[3])
    beta = mx.random.uniform(0.0, 1.0, (B, H, L), key=keys[4])
    state = mx.random.normal((B, H, Dk, Dv), key=keys[5]) * 0.1
    return [q, k, v, g, beta, state]


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs Metal")
@pytest.mark.parametrize("shape", [(2, 4, 1, 12, 10), (1, 32, 1, 128, 128), (3, 8, 4, 128, 128)])
def test_metal_kernel_equals_the_ops_form(shape):
    args = inputs(*shape)
    with mx.stream(mx.gpu):
        out, states = metal_recurrent_delta_rule(*args)
        mx.eval(out, states)
    with mx.stream(mx.cpu):
        ref_out, ref_states = recurrent_delta_rule(*args)
        mx.eval(ref_out, ref_states)
    assert len(states) == len(ref_states) == shape[2]
    assert mx.allclose(out, ref_out, atol=1e-5, rtol=1e-5).item()
    for got, want in zip(states, ref_states):
        assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item()


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs Metal")
def test_delta_rule_uses_the_kernel_on_the_gpu(monkeypatch):
    """On a Metal GPU, decode and the kept last tokens go through the kernel (and agree)."""
    calls = []
    monkeypatch.setattr(gated_delta, "metal_recurrent_delta_rule",
                        lambda *a: calls.append(a[0].shape) or metal_recurrent_delta_rule(*a))
    args = inputs(2, 4, 3, 12, 10)
    with mx.stream(mx.gpu):
        out, states = delta_rule(*args, keep=2)
    with cpu_default_device():
        ref_out, ref_states = delta_rule(*args, keep=2)
    assert calls and mx.allclose(out, ref_out, atol=1e-5).item()
    assert len(states) == len(ref_states) == 3


def test_the_ops_form_off_metal(monkeypatch):
    """With the CPU as the default device the ops form runs (the kernel is never called)."""
    monkeypatch.setattr(gated_delta, "metal_recurrent_delta_rule", lambda *a: pytest.fail("the kernel ran"))
    with cpu_default_device():
        assert not uses_kernel()
        args = inputs(2, 4, 3, 12, 10)
        out, states = delta_rule(*args, keep=3)
        ref_out, ref_states = recurrent_delta_rule(*args)
    assert mx.array_equal(out, ref_out).item() and len(states) == 4
