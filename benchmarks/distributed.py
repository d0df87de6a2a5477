"""Two ranks (``mlx.launch --backend ring`` on 127.0.0.1) against one process, same weights,
runs interleaved: load peak memory per rank, prefill and decode tokens/s, and the share of a
decode step that is communication.

The communication share is measured directly: the same messages a decode step exchanges
(pipeline: a header and the hidden state to rank 1 and the hidden state back; tensor:
``2 * layers`` all_sums of one hidden state), timed alone, divided by the decode step time.
On one 2-core machine the ranks also compete for the cores, so 2 ranks are expected to be
slower than 1 process here; across machines each rank has its own.

    python benchmarks/distributed.py [--tokens 32] [--prompt 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
REPEATS = 30


def timed_generation(model, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(prefill tok/s, decode seconds per token) of greedy generation with a fresh cache."""
    from mlxformer.cache import make_cache
    from mlxformer.generation.decoding import DecodingState
    from mlxformer.generation.stream import decode

    state = DecodingState(prompt, max_tokens=tokens, cache=make_cache(model))  # greedy, eos not checked
    start = time.perf_counter()
    stream = decode(model, state)
    next(stream)
    first = time.perf_counter()
    count = sum(1 for _ in stream)
    end = time.perf_counter()
    return len(prompt) / (first - start), (end - first) / max(count, 1)


def comm_seconds(group, parallel: str, hidden: int, layers: int) -> float:
    """Seconds of the messages of one decode step, exchanged alone (no compute)."""
    h = mx.ones((1, 1, hidden), mx.float32)
    header = mx.array([1, 1, 0], mx.int32)
    rank, size = group.rank(), group.size()
    start = time.perf_counter()
    for _ in range(REPEATS):
        if parallel == "tensor":
            x = h
            for _ in range(2 * layers):
                x = mx.distributed.all_sum(x, group=group)
                mx.eval(x)
        elif rank == 0:
            mx.eval(mx.distributed.send(header, 1, group=group))
            mx.eval(mx.distributed.send(h, 1, group=group))
            mx.eval(mx.distributed.recv(h.shape, h.dtype, size - 1, group=group))
        else:
            mx.eval(mx.distributed.recv((3,), mx.int32, rank - 1, group=group))
            x = mx.distributed.recv(h.shape, h.dtype, rank - 1, group=group)
            mx.eval(x)
            if (rank + 1) % size:
                mx.eval(mx.distributed.send(header, rank + 1, group=group))
            mx.eval(mx.distributed.send(x, (rank + 1) % size, group=group))
    return (time.perf_counter() - start) / REPEATS


def worker(args: argparse.Namespace) -> None:
    """One measurement: prints a JSON line (rank 0 only)."""
    mx.set_default_device(mx.cpu)
    prompt = [(7 * i + 3) % 200 for i in range(args.prompt)]
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    if args.worker == "single":
        from mlxformer.loader import apply_dtype_policy, build_model, read_checkpoint

        model = build_model(*read_checkpoint(Path(args.model))[:2])
        apply_dtype_policy(model, None)
        mx.eval(model.parameters())
        peak = mx.get_peak_memory() - base
        prefill_tps, step = timed_generation(model, prompt, args.tokens)
        print(json.dumps({"peaks": [peak], "prefill_tps": prefill_tps, "step": step}))
        return
    from mlxformer.distributed.pipeline import serve_stage
    from mlxformer.distributed.runner import load_distributed

    dist = load_distributed(args.model, args.worker, with_tokenizer=False)
    peak = mx.get_peak_memory() - base
    peaks = mx.distributed.all_gather(mx.array([peak], mx.float32), group=dist.group).tolist()
    if args.worker == "pipeline" and not dist.leader:
        serve_stage(dist.model, dist.group, dist.watchdog)
        prefill_tps = step = 0.0
    else:
        prefill_tps, step = timed_generation(dist.model, prompt, args.tokens)
        if dist.link is not None:
            dist.link.stop()
    comm = comm_seconds(dist.group, args.worker, dist.model.args.hidden_size, len(dist.model.layers))
    if dist.leader:
        print(json.dumps({"peaks": peaks, "prefill_tps": prefill_tps, "step": step, "comm": comm}))


def run(mode: str, model: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--worker", mode, "--model", model,
               "--tokens", str(args.tokens), "--prompt", str(args.prompt)]
    if mode != "single":
        command = ["mlx.launch", "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2", "--", *command]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200, env=env, start_new_session=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"{mode} on {model} failed:\n{done.stderr[-2000:]}")
    return json.loads(lines[-1])


def random_checkpoint(directory: Path) -> Path:
    """A float32 llama whose heads divide by 2 and whose layers outweigh the embedding."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", vocab_size=2048, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", choices=("single", "pipeline", "tensor"))
    parser.add_argument("--model")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from mlxformer.default_model import default_model_path

    with tempfile.TemporaryDirectory() as tmp:
        cases = {
            "SmolLM2-135M Q4_1 GGUF": (str(default_model_path()), ("single", "pipeline")),
            "random llama 12x768 f32": (str(random_checkpoint(Path(tmp))), ("single", "pipeline", "tensor")),
        }
        results: dict[tuple[str, str], list[dict]] = {}
        for _ in range(args.rounds):  # interleaved: every mode once per round
            for name, (path, modes) in cases.items():
                for mode in modes:
                    results.setdefault((name, mode), []).append(run(mode, path, args))
    print(f"prompt {args.prompt} tokens, {args.tokens} generated, median of {args.rounds} rounds; "
          "2 ranks on one 2-core machine over loopback")
    print("| model | mode | load peak per rank (MB) | vs 1 process | prefill tok/s | decode tok/s | vs 1 process | comm share of a step |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (_, modes) in cases.items():
        single = results[(name, "single")]
        single_peak = statistics.median(r["peaks"][0] for r in single)
        single_tps = statistics.median(1 / r["step"] for r in single)
        for mode in modes:
            rs = results[(name, mode)]
            peaks = [statistics.median(r["peaks"][i] for r in rs) for i in range(len(rs[0]["peaks"]))]
            tps = statistics.median(1 / r["step"] for r in rs)
            prefill = statistics.median(r["prefill_tps"] for r in rs)
            comm = f"{statistics.median(r['comm'] * r_step for r, r_step in ((r, 1 / r['step']) for r in rs)):.0%}" if mode != "single" else "-"
            print(f"| {name} | {mode} | {' / '.join(f'{p / 1e6:.1f}' for p in peaks)} | "
                  f"{max(peaks) / single_peak:.2f}x | {prefill:.1f} | {tps:.1f} | {tps / single_tps:.2f}x | {comm} |")


if __name__ == "__main__":
    main()
