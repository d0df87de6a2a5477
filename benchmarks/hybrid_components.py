"""Hybrid (Qwen3.5-MoE-shaped) model, component by component: mlxformer beside mlx-lm in one process.

Both runtimes load the same dir (``benchmarks/hybrid.py --write``); each component runs on the
same random input, A B B A interleaved, and the best of each pair of runs is kept:

- ``deltanet``: layer 0's Gated DeltaNet mixer (projections, conv, the rule, the gated norm,
  ``out_proj``) over ``--tokens`` tokens from the zero state;
- ``rule``: the delta rule alone (ours: ``delta_rule``, the chunked form for a prompt, the
  recurrent one for a token; mlx-lm: ``gated_delta_update``, its ops loop on the CPU);
- ``attention``: the last layer's gated attention mixer (causal, no cache);
- ``moe``: layer 0's MoE block (router, routed experts, gated shared expert);
- ``lm_head``: the vocabulary projection of one position.

On the CPU both compute in float32 (see ``hybrid.py``'s worker). ``--tokens 1`` is a decode
step's work; a prompt's is ``--tokens 128`` (mlxformer's CPU prefill chunk).

  python benchmarks/hybrid_components.py --model-dir .bench/qwen35-moe-shaped/float --tokens 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))

from serving import load_average  # noqa: E402  (benchmarks/ is not a package)


def best_ms(run: Callable[[], object], reps: int) -> float:
    """Median wall time of ``reps`` evaluations of ``run()`` after one warm-up, in ms."""
    mx.eval(run())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def components(model_dir: str, tokens: int) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """Each component's (mlxformer, mlx-lm) call on the same input."""
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.models.gated_delta import gated_delta_update

    from mlxformer import load
    from mlxformer.models.gated_delta import delta_rule, l2_normalize
    from mlxformer.models.mask import causal_mask_for

    on_cpu = mx.default_device() == mx.cpu
    quantized = "quantization" in json.loads((Path(model_dir) / "config.json").read_text())
    ours, _ = load(model_dir, dtype=mx.float32) if on_cpu and not quantized else load(model_dir)
    theirs, _ = mlx_lm_load(model_dir)
    if on_cpu:
        theirs.set_dtype(mx.float32)
    dtype = mx.float32 if on_cpu else mx.bfloat16
    mine, their_layers = ours.model.layers, theirs.language_model.model.layers
    last = len(mine) - 1
    x = mx.random.normal((1, tokens, ours.args.hidden_size), key=mx.random.key(0)).astype(dtype)
    mask = causal_mask_for(tokens, tokens, None)

    # the rule's inputs: value heads H, key heads Hk (ours repeats q/k to the value heads)
    a = ours.args
    H, Hk, Dk, Dv = a.linear_num_value_heads, a.linear_num_key_heads, a.linear_key_head_dim, a.linear_value_head_dim
    keys = mx.random.split(mx.random.key(1), 5)
    q = l2_normalize(mx.random.normal((1, tokens, Hk, Dk), key=keys[0])) * Dk**-0.5  # (B, T, Hk, Dk)
    k = l2_normalize(mx.random.normal((1, tokens, Hk, Dk), key=keys[1]))
    v = mx.random.normal((1, tokens, H, Dv), key=keys[2])
    a_in, b_in = mx.random.normal((1, tokens, H), key=keys[3]), mx.random.normal((1, tokens, H), key=keys[4])
    A_log, dt_bias = mx.zeros((H,)), mx.ones((H,))
    g = -mx.exp(A_log) * mx.logaddexp(a_in + dt_bias, 0.0)  # log of the decay, (B, T, H)

    def our_rule() -> object:
        # (B, T, Hk, D) -> (B, H, T, D), q/k repeated to the value heads
        qh, kh = (mx.repeat(t, H // Hk, axis=2).transpose(0, 2, 1, 3) for t in (q, k))
        out, _ = delta_rule(qh, kh, v.transpose(0, 2, 1, 3), g.transpose(0, 2, 1), mx.sigmoid(b_in).transpose(0, 2, 1),
                            mx.zeros((1, H, Dk, Dv)), 1)
        return out

    def their_rule() -> object:
        return gated_delta_update(q, k, v, a_in, b_in, A_log, dt_bias)[0]

    return {
        "deltanet": (lambda: mine[0].linear_attn(x, None, None), lambda: their_layers[0].linear_attn(x, None, None)),
        "rule": (our_rule, their_rule),
        "attention": (lambda: mine[last].self_attn(x, mask, None),
                      lambda: their_layers[last].self_attn(x, "causal" if tokens > 1 else None, None)),
        "moe": (lambda: mine[0].mlp(x), lambda: their_layers[0].mlp(x)),
        "lm_head": (lambda: ours.logits(x[:, -1:]), lambda: theirs.language_model.lm_head(x[:, -1:])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--only", nargs="*", help="component names (default: all)")
    args = parser.parse_args()
    print(f"# {args.model_dir} | {args.tokens} tokens | {mx.default_device()} | load {load_average()}")
    print("| component | mlxformer ms | mlx-lm ms | mlx-lm / mlxformer |")
    print("|---|---:|---:|---:|")
    for name, (ours, theirs) in components(args.model_dir, args.tokens).items():
        if args.only and name not in args.only:
            continue
        a1, b1, b2, a2 = best_ms(ours, args.reps), best_ms(theirs, args.reps), best_ms(theirs, args.reps), best_ms(ours, args.reps)
        mine, other = min(a1, a2), min(b1, b2)
        print(f"| {name} | {mine:.1f} | {other:.1f} | {other / mine:.2f} |", flush=True)
    print(f"load after: {load_average()}")


if __name__ == "__main__":
    main()
