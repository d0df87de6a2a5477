"""Decode speed and KV cache memory at a long context: float / 8-bit / 4-bit caches,
mlxformer beside mlx-lm's own caches (the reference peer), trials interleaved in one run.

Both libraries run the same weights (the default SmolLM2-135M-Instruct, loaded by mlxformer
and copied into an ``mlx_lm.models.llama.Model`` quantized the same way) in float32.
By default the context is filled with random keys/values through each cache's own
``update_and_fetch`` (decode cost depends on the context length, not its content; a real
2k-token prefill takes minutes on a small CPU); ``--prefill`` fills it with a real prompt.

    python benchmarks/kv_cache.py [--context 2048] [--tokens 16] [--trials 3] [--prefill]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxformer.cache import CacheSettings, make_cache
from mlxformer.default_model import default_model_path
from mlxformer.loader import load
from mlxformer.models.decoder import Model

KINDS: dict[str, int | None] = {"float": None, "8-bit": 8, "4-bit": 4}
GROUP_SIZE = 64


def mlx_lm_twin(model: Model) -> nn.Module:
    """An mlx-lm Llama holding exactly ``model``'s (quantized) weights."""
    from mlx_lm.models import llama

    twin = llama.Model(llama.ModelArgs.from_dict(model.args.to_dict()))
    ours = dict(model.named_modules())

    def predicate(path: str, module: nn.Module) -> bool | dict[str, int]:
        source = ours.get(path)
        if isinstance(source, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            return {"group_size": source.group_size, "bits": source.bits}
        return False

    nn.quantize(twin, class_predicate=predicate)
    twin.load_weights(tree_flatten(model.parameters()), strict=True)
    mx.eval(twin.parameters())
    return twin


def mlx_lm_cache(twin: nn.Module, bits: int | None) -> list[Any]:
    from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

    if bits is None:
        return make_prompt_cache(twin)
    return [QuantizedKVCache(group_size=GROUP_SIZE, bits=bits) for _ in twin.layers]


def fill(run: Callable[..., mx.array], cache: list[Any], args: Model, context: int, prompt: list[int] | None) -> None:
    """Bring ``cache`` to ``context`` tokens: a real prefill, or random keys/values."""
    if prompt is not None:
        for start in range(0, context, 256):
            run(mx.array(prompt[start : start + 256])[None], cache)
            mx.eval([c.state for c in cache])
        return
    mx.random.seed(0)
    shape = (1, args.args.num_key_value_heads, context, args.args.head_dim)
    for c in cache:
        c.update_and_fetch(mx.random.normal(shape) * 2.0, mx.random.normal(shape))
    mx.eval([c.state for c in cache])


def decode_tps(run: Callable[..., mx.array], cache: list[Any], n_tokens: int) -> float:
    """Greedy decode ``n_tokens`` one at a time; tokens per second (the first step is warm-up)."""
    token = mx.array([[1]])
    start = 0.0
    for i in range(n_tokens + 1):
        if i == 1:
            start = time.perf_counter()
        token = mx.argmax(run(token, cache)[:, -1, :], axis=-1)[None]
        mx.eval(token)
    return n_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=16, help="decode steps timed per trial")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--prefill", action="store_true", help="fill the context with a real prompt")
    args = parser.parse_args()

    model, tokenizer = load(default_model_path())
    twin = mlx_lm_twin(model)
    prompt = None
    if args.prefill:
        text = "The quick brown fox jumps over the lazy dog. " * (args.context // 5)
        prompt = tokenizer.encode(text)[: args.context]

    runs = {"mlxformer": (lambda x, c: model(x, c)), "mlx-lm": (lambda x, c: twin(x, cache=c))}
    caches = {
        "mlxformer": lambda bits: make_cache(model, CacheSettings(kv_bits=bits, kv_group_size=GROUP_SIZE)),
        "mlx-lm": lambda bits: mlx_lm_cache(twin, bits),
    }
    speed: dict[tuple[str, str], list[float]] = {}
    memory: dict[tuple[str, str], int] = {}
    for trial in range(args.trials):
        for kind, bits in KINDS.items():
            for lib in ("mlxformer", "mlx-lm"):  # interleaved: every trial runs every pair
                cache = caches[lib](bits)
                fill(runs[lib], cache, model, args.context, prompt)
                memory[(lib, kind)] = sum(c.nbytes for c in cache)
                speed.setdefault((lib, kind), []).append(decode_tps(runs[lib], cache, args.tokens))
                del cache
        print(f"trial {trial + 1}/{args.trials} done", flush=True)

    print(f"\ncontext {args.context} tokens ({'real prefill' if args.prefill else 'random K/V fill'}), "
          f"{args.tokens} decode steps x {args.trials} trials, SmolLM2-135M float32 activations, group {GROUP_SIZE}")
    print(f"{'cache':<7} {'mlxformer tok/s':>16} {'mlx-lm tok/s':>13} {'speed ratio':>12} "
          f"{'mlxformer MB':>13} {'mlx-lm MB':>10} {'vs float':>9}")
    for kind in KINDS:
        ours, peer = (statistics.median(speed[(lib, kind)]) for lib in ("mlxformer", "mlx-lm"))
        mb_ours, mb_peer = memory[("mlxformer", kind)] / 1e6, memory[("mlx-lm", kind)] / 1e6
        vs_float = memory[("mlxformer", kind)] / memory[("mlxformer", "float")]
        print(f"{kind:<7} {ours:>16.2f} {peer:>13.2f} {ours / peer:>11.2f}x {mb_ours:>13.2f} {mb_peer:>10.2f} {vs_float:>8.2f}x")


if __name__ == "__main__":
    main()
