"""mlxformer beside mlx-lm on the same model files, trials interleaved A B A B in one run.

Trials alternate A B / B A. Each trial runs in its own subprocess, so peak memory is that runtime's alone. Both runtimes
get the same random prompt and generate greedily without stopping at eos; prefill speed is
prompt tokens over the time to the first token, decode speed is the remaining tokens over
their time. Prints per-model medians and the mlxformer/mlx-lm ratios (higher is better for
speed, lower for memory).

Usage:
  python benchmarks/prepare_models.py            # once: writes .bench/models
  python benchmarks/vs_mlx_lm.py [--models smollm2-f32 smollm2-bf16 ...] [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from datetime import date
from pathlib import Path

DEFAULT_MODELS = ["smollm2-f32", "smollm2-bf16", "smollm2-8bit", "smollm2-4bit", "llama-1b-bf16"]
RUNTIMES = ("mlxformer", "mlx-lm")


def mlx_lm_loop(model, **extra):  # type: ignore[no-untyped-def]
    """mlx-lm's greedy token loop over ``model`` (``extra``: generate_step's options), in the
    ``(prompt, n) -> token ids`` form ``mlxformer.tools.bench.measure`` times."""
    from mlx_lm.generate import generate_step

    def loop(prompt, n: int):  # type: ignore[no-untyped-def]
        for count, (token, _) in enumerate(generate_step(prompt, model, max_tokens=n, **extra), start=1):
            yield int(token)
            if count == n:
                break

    return loop


def worker(runtime: str, model_dir: str, prompt_tokens: int, generation_tokens: int, kv_bits: int | None) -> None:
    """Run one trial in this process and print its JSON."""
    from mlxformer.tools.bench import measure, mlxformer_loop, random_prompt
    from mlxformer.cache import CacheSettings

    if runtime == "mlxformer":
        from mlxformer import load

        model, _ = load(model_dir)
        loop = mlxformer_loop(model, CacheSettings(kv_bits=kv_bits))
        vocab = model.args.vocab_size
    else:
        from mlx_lm import load as mlx_lm_load

        model, _ = mlx_lm_load(model_dir)
        vocab = model.args.vocab_size
        loop = mlx_lm_loop(model, **({"kv_bits": kv_bits, "quantized_kv_start": 0} if kv_bits else {}))

    prompt = random_prompt(vocab, prompt_tokens)
    measure(loop, prompt[:16], 4)  # warm-up
    trial = measure(loop, prompt, generation_tokens)
    print(json.dumps(trial.__dict__))


def run_trial(runtime: str, model_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    command = [
        sys.executable, __file__, "--worker", runtime, "--model-dir", str(model_dir),
        "--prompt-tokens", str(args.prompt_tokens), "--generation-tokens", str(args.generation_tokens),
    ]
    if args.kv_bits:
        command += ["--kv-bits", str(args.kv_bits)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{runtime} trial on {model_dir} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models-dir", type=Path, default=Path(".bench/models"))
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--generation-tokens", type=int, default=64)
    parser.add_argument("--kv-bits", type=int, choices=(4, 8), default=None)
    parser.add_argument("--worker", choices=RUNTIMES, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.model_dir, args.prompt_tokens, args.generation_tokens, args.kv_bits)
        return

    import mlx.core as mx

    print(f"# {date.today()} | {platform.machine()} {platform.system()} | MLX {mx.__version__} | "
          f"device {mx.default_device()} | prompt {args.prompt_tokens} tok, generate {args.generation_tokens} tok, "
          f"{args.trials} interleaved trials, medians")
    print("| model | runtime | prefill tok/s | decode tok/s | peak GB | prefill × | decode × | memory × |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models:
        model_dir = args.models_dir / name
        if not model_dir.exists():
            print(f"| {name} | (missing: run benchmarks/prepare_models.py) |||||||")
            continue
        results: dict[str, list[dict[str, float]]] = {r: [] for r in RUNTIMES}
        for trial in range(args.trials):
            # A B, B A, A B, ...: alternating who goes first cancels any order bias.
            for runtime in RUNTIMES if trial % 2 == 0 else RUNTIMES[::-1]:
                results[runtime].append(run_trial(runtime, model_dir, args))
        medians = {
            r: {k: statistics.median(t[k] for t in trials) for k in ("prefill_tps", "decode_tps", "peak_memory_gb")}
            for r, trials in results.items()
        }
        ours, theirs = medians["mlxformer"], medians["mlx-lm"]
        for runtime in RUNTIMES:
            m = medians[runtime]
            ratios = (
                f"{ours['prefill_tps'] / theirs['prefill_tps']:.2f} | {ours['decode_tps'] / theirs['decode_tps']:.2f} | "
                f"{ours['peak_memory_gb'] / theirs['peak_memory_gb']:.2f}"
                if runtime == "mlxformer" else " | | "
            )
            print(f"| {name} | {runtime} | {m['prefill_tps']:.1f} | {m['decode_tps']:.2f} | "
                  f"{m['peak_memory_gb']:.3f} | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
