"""Where an MLA prefill spends its time: mlxformer's and mlx-lm's components side by side.

Both runtimes load the same checkpoint (``benchmarks/mla.py --write``) in one process; each
component runs on the same evaluated inputs (a random ``--tokens``-token hidden state) and is
timed to its evaluated output, the two runtimes interleaved, medians of ``--repeats``:
the attention (projections, latent cache write, kv_b expansion, attention, o_proj), the
router, the routed experts (with the shared one), the dense MLP, a layer norm, the
vocabulary projection of one row, and the whole prefill as each runtime's loop runs it.

Usage:
  python benchmarks/mla_profile.py --model-dir DIR [--tokens 128 --repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import mlx.core as mx


def timed(run: Callable[[], object]) -> tuple[float, float]:
    """Wall and CPU seconds (this process's threads, every stream) to build and evaluate
    ``run()``'s output. On a loaded machine the CPU time is the steadier figure of the work."""
    mx.synchronize()
    start, cpu = time.perf_counter(), time.process_time()
    mx.eval(run())
    mx.synchronize()
    return time.perf_counter() - start, time.process_time() - cpu


def components(model_dir: Path, tokens: int) -> dict[str, dict[str, Callable[[], object]]]:
    """Per runtime, the component name -> a zero-argument call returning its output."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from mlxformer import load
    from mlxformer.cache import make_cache
    from mlxformer.generation.steps import prefill

    ours, _ = load(str(model_dir))
    theirs, _ = load_model(model_dir)
    theirs.set_dtype(mx.float32)  # mlx-lm's gather_mm is float32-only on the CPU; ours casts too
    hidden = ours.args.hidden_size
    x = mx.random.normal((1, tokens, hidden), key=mx.random.key(0)).astype(mx.float32)
    rows = x.reshape(tokens, hidden)
    prompt = mx.random.randint(0, ours.args.vocab_size, (tokens,), key=mx.random.key(1))
    mx.eval(x, rows, prompt)
    a_ours, a_theirs = ours.layers[1].self_attn, theirs.model.layers[1].self_attn
    m_ours, m_theirs = ours.layers[1].mlp, theirs.model.layers[1].mlp

    def attn_ours() -> mx.array:
        cache = make_cache(ours)[1]
        return a_ours(x, cache.make_mask(tokens, None), cache)

    def attn_theirs() -> mx.array:
        cache = make_prompt_cache(theirs)[1]
        return a_theirs(x, cache.make_mask(tokens, window_size=None, return_array=True), cache)

    def experts_ours() -> mx.array:
        indices, weights = m_ours.route(rows)
        return (m_ours.switch_mlp(rows, indices) * weights[..., None]).sum(axis=1) + m_ours.shared_experts(rows)

    def experts_theirs() -> mx.array:
        indices, scores = m_theirs.gate(x)
        return (m_theirs.switch_mlp(x, indices) * scores[..., None]).sum(axis=-2) + m_theirs.shared_experts(x)

    def prefill_theirs() -> mx.array:  # generate_step: all but the last token, then the last one's logits
        cache = make_prompt_cache(theirs)
        theirs(prompt[None, :-1], cache=cache)
        mx.eval([c.state for c in cache])
        return theirs(prompt[None, -1:], cache=cache)[:, -1, :]

    return {
        "mlxformer": {
            "attention": attn_ours, "router": lambda: m_ours.route(rows), "moe block": lambda: m_ours(x),
            "experts+shared": experts_ours, "dense mlp": lambda: ours.layers[0].mlp(x),
            "norm": lambda: ours.layers[1].input_layernorm(x), "lm_head 1 row": lambda: ours.logits(x[:, -1]),
            "layer 0": lambda: ours.layers[0](x, make_cache(ours)[0].make_mask(tokens, None), make_cache(ours)[0]),
            "prefill": lambda: prefill(ours, prompt, make_cache(ours)),
        },
        "mlx-lm": {
            "attention": attn_theirs, "router": lambda: m_theirs.gate(x), "moe block": lambda: m_theirs(x),
            "experts+shared": experts_theirs, "dense mlp": lambda: theirs.model.layers[0].mlp(x),
            "norm": lambda: theirs.model.layers[1].input_layernorm(x), "lm_head 1 row": lambda: theirs.lm_head(x[:, -1]),
            "layer 0": lambda: theirs.model.layers[0](x, make_prompt_cache(theirs)[0].make_mask(tokens, window_size=None, return_array=True),
                                                      make_prompt_cache(theirs)[0]),
            "prefill": prefill_theirs,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path(".bench/glm47-flash-shaped"))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", nargs="*", help="component names to time (default: all)")
    args = parser.parse_args()
    calls = components(args.model_dir, args.tokens)
    names = [n for n in calls["mlxformer"] if not args.only or n in args.only]
    times: dict[str, dict[str, list[tuple[float, float]]]] = {r: {n: [] for n in names} for r in calls}
    for name in names:  # one warm-up each
        for runtime in calls:
            timed(calls[runtime][name])
    for repeat in range(args.repeats):
        for name in names:
            for runtime in (list(calls) if repeat % 2 == 0 else list(calls)[::-1]):
                times[runtime][name].append(timed(calls[runtime][name]))
    print(f"# {args.tokens} tokens, {args.repeats} interleaved repeats, medians | load {os.getloadavg()[0]:.2f}")
    print("| component | mlxformer wall ms | mlx-lm wall ms | wall ours / theirs | mlxformer CPU ms | mlx-lm CPU ms | CPU ours / theirs |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        cells = []
        for kind in (0, 1):
            ours, theirs = (statistics.median(t[kind] for t in times[r][name]) * 1e3 for r in ("mlxformer", "mlx-lm"))
            cells.append(f"{ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}")
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
