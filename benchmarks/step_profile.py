"""A decode step's structure, engine-level: host time against batch and context, graph size,
host syncs, and the share of the step that is matmul.

1. **Host time** (issue 32: batch 32 at 32k-token contexts within 1 ms of batch 1): the time to
   build a batched decode step (the batch's layout, the decoder's graph and the sampling graph,
   everything before the evaluation) on a narrow random decoder (``--layers``, one KV head of
   32, SmolLM2's vocabulary) whose caches are filled with zero keys and values, so that 32 x 32k
   tokens of real KV fit (about 0.5 GB in bfloat16) and no prompt is computed. Beside it the
   evaluation's time (the device work, which does grow with the context).
2. **Primitives** of one step's graph (decoder + sampling) at batch 1 / 8 / 32, greedy and
   temperature 1 with top-p 0.9 (MLX's DOT export of the unevaluated graph).
3. **Host syncs per engine step**: ``mx.eval`` (blocking) and ``mx.async_eval`` calls made on
   the engine's thread, per ``Engine.step``, with 8 concurrent requests on ``--model``.
4. **Matmul share** on ``--model``: a batched decode step at batch 1 and 8 against its
   projections alone (every Linear and the vocabulary projection at M = batch,
   ``decode_profile.time_matmuls``), in wall time and in the process's CPU time (the step
   overlaps its projections on two CPU streams: the CPU share is the one to read): where that
   share is high, the CPU's matmuls bound any ratio a runtime can reach (MLX's Linux wheel
   links the reference BLAS for float32; bfloat16 uses MLX's own CPU kernel, single-threaded).
   Each ``--model`` run adds its figures beside the earlier runs' in ``step_profile.json``.

Usage: python benchmarks/step_profile.py [--model .bench/models/smollm2-f32] [--context 32768] [--parts host ops syncs matmul]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import threading
import time
from datetime import date
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx

from decode_profile import time_matmuls
from mlxformer.cache import make_cache
from mlxformer.sampling.choosing import ChoiceRow, choose, draw_key
from mlxformer.engine.batch_runner import BatchRunner
from mlxformer.models.config import ModelArgs
from mlxformer.models.decoder import Model
from mlxformer.sampling.options import SamplingSettings
from serving import load_average

SETTINGS = {"greedy": SamplingSettings(), "temp 1, top-p 0.9": SamplingSettings(temp=1.0, top_p=0.9, seed=0)}


def narrow_model(layers: int) -> Model:
    """A random Llama decoder, narrow (one KV head of 32) so that 32 x 32k tokens of KV fit."""
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": layers,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 49152,
              "rms_norm_eps": 1e-5, "max_position_embeddings": 65536, "tie_word_embeddings": True}
    model = Model(ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def filled(model: Model, lengths: list[int]) -> list[SimpleNamespace]:
    """Decoding rows (the runner's ``Decoding``) whose caches hold ``lengths`` tokens of zero K/V."""
    args, rows = model.args, []
    dtype = model.model.norm.weight.dtype
    for i, n in enumerate(lengths):
        cache = make_cache(model)
        for layer in cache:
            shape = (1, args.num_key_value_heads, n, args.head_dim)  # (1, kv heads, T, head dim)
            layer.update_and_fetch(mx.zeros(shape, dtype), mx.zeros(shape, dtype))
        mx.eval([a for layer in cache for a in layer.state])
        rows.append(SimpleNamespace(cache=cache, speculator=None, last_token=5 + i, length=n))
    return rows


def build_step(runner: BatchRunner, rows: list[SimpleNamespace], sampling: SamplingSettings,
               step: int) -> tuple[mx.array, mx.array]:
    """One decode step's tokens and log-probabilities, unevaluated (the host's part of a step)."""
    logits = runner.decode(rows)  # (B, vocab)
    key = None if sampling.greedy else draw_key(sampling.seed or 0, step)
    return choose(logits, [ChoiceRow(sampling, (), r.length, key) for r in rows])


def host_time(model: Model, lengths: list[int], sampling: SamplingSettings, steps: int) -> dict[str, float]:
    """Median and best host time of a step (build) and median evaluation time, in ms."""
    runner, rows = BatchRunner(model), filled(model, lengths)
    mx.eval(build_step(runner, rows, sampling, 0))  # joins the batch (and grows it by a block)
    hosts, evals = [], []
    for step in range(1, steps + 1):
        begun = time.perf_counter()
        tokens, logprobs = build_step(runner, rows, sampling, step)
        built = time.perf_counter()
        mx.eval(tokens, logprobs)
        evals.append(time.perf_counter() - built)
        hosts.append(built - begun)
        for row, token in zip(rows, tokens.tolist()):
            row.last_token, row.length = token, row.length + 1
    return {"host_ms_median": 1e3 * statistics.median(hosts), "host_ms_best": 1e3 * min(hosts),
            "eval_ms_median": 1e3 * statistics.median(evals)}


def graph_ops(arrays: tuple[mx.array, ...]) -> int:
    """Primitives in the unevaluated graph of ``arrays`` (rectangles of MLX's DOT export)."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "step.dot"
        mx.export_to_dot(str(path), *arrays)
        return len(re.findall(r"shape=rectangle", path.read_text()))


def step_ops(model: Model, batch: int, sampling: SamplingSettings) -> int:
    """Primitives of the second decode step of ``batch`` rows (the first joins the batch)."""
    runner, rows = BatchRunner(model), filled(model, [40 + 3 * i for i in range(batch)])
    mx.eval(build_step(runner, rows, sampling, 0))
    return graph_ops(build_step(runner, rows, sampling, 1))


def engine_syncs(model_path: str, clients: int, tokens: int) -> dict[str, float]:
    """``mx.eval`` / ``mx.async_eval`` calls on the engine's thread per engine step."""
    from mlxformer import load
    from mlxformer.engine import Engine, GenerationRequest

    model, tokenizer = load(model_path)
    counts = {"eval": 0, "async_eval": 0, "steps": 0}
    originals = {name: getattr(mx, name) for name in ("eval", "async_eval")}

    def counting(name: str):  # type: ignore[no-untyped-def]
        def call(*arrays, **kwargs):  # type: ignore[no-untyped-def]
            if threading.current_thread().name == "mlxformer-engine":
                counts[name] += 1
            return originals[name](*arrays, **kwargs)
        return call

    with Engine(model, tokenizer, max_batch=clients, prefix_cache_bytes=0) as engine:
        step = engine.step

        def counted_step() -> None:
            counts["steps"] += 1
            step()

        engine.step = counted_step  # type: ignore[method-assign]
        prompts = [tokenizer.encode_prompt(f"Write a story about the number {i}.") for i in range(clients)]
        list(engine.submit(GenerationRequest(prompts[0], max_tokens=2)))  # warm-up
        counts.update(eval=0, async_eval=0, steps=0)
        for name in originals:
            setattr(mx, name, counting(name))
        try:
            handles = [engine.submit(GenerationRequest(p, max_tokens=tokens)) for p in prompts]
            for handle in handles:
                list(handle)
        finally:
            for name, original in originals.items():
                setattr(mx, name, original)
    steps = max(counts["steps"], 1)
    return {"steps": counts["steps"], "eval_per_step": counts["eval"] / steps,
            "async_eval_per_step": counts["async_eval"] / steps}


def matmul_share(model_path: str, batch: int, context: int, steps: int) -> dict[str, float]:
    """A batched decode step (``batch`` rows of ``context`` tokens) against its projections
    alone: wall time, and CPU time of the whole process (the step runs its projections on two
    CPU streams at once, the projections alone on one: their CPU times compare, their wall
    times do not)."""
    from mlxformer import load

    model, _ = load(model_path)
    runner = BatchRunner(model)
    rows = []
    for i in range(batch):
        cache = make_cache(model)
        runner.prefill([(7 * i + j) % 1000 + 100 for j in range(context)], cache, want_logits=False)
        rows.append(SimpleNamespace(cache=cache, speculator=None, last_token=5 + i))
    mx.eval(runner.decode(rows))  # joins the batch
    begun, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        tokens = mx.argmax(runner.decode(rows), axis=-1)
        mx.eval(tokens)
        for row, token in zip(rows, tokens.tolist()):
            row.last_token = token
    step, step_cpu = (time.perf_counter() - begun) / steps, (time.process_time() - cpu) / steps
    cpu = time.process_time()
    matmuls = time_matmuls(model, steps, rows=batch)
    matmuls_cpu = (time.process_time() - cpu) / (steps + 1)  # time_matmuls runs one warm-up step
    return {"step_ms": 1e3 * step, "projections_ms": 1e3 * matmuls, "matmul_share": matmuls / step,
            "step_cpu_ms": 1e3 * step_cpu, "projections_cpu_ms": 1e3 * matmuls_cpu,
            "matmul_cpu_share": matmuls_cpu / step_cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=".bench/models/smollm2-f32", help="for the syncs and the matmul share")
    parser.add_argument("--parts", nargs="+", choices=("host", "ops", "syncs", "matmul"),
                        default=["host", "ops", "syncs", "matmul"])
    parser.add_argument("--layers", type=int, default=4, help="layers of the narrow decoder (host time, ops)")
    parser.add_argument("--context", type=int, default=32768, help="tokens per row at batch 32 (host time)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    result: dict = {"date": str(date.today()), "load_start": load_average()}
    if "host" in args.parts or "ops" in args.parts:
        narrow = narrow_model(args.layers)
    if "host" in args.parts:
        result["host"] = {}
        for name, sampling in SETTINGS.items():
            small = host_time(narrow, [16], sampling, args.steps)
            large = host_time(narrow, [args.context - 7 * i for i in range(32)], sampling, args.steps)
            result["host"][name] = {"batch 1 x 16": small, f"batch 32 x {args.context}": large,
                                    "host_ms_difference": large["host_ms_median"] - small["host_ms_median"]}
            print(f"host time, {name}: {json.dumps(result['host'][name])}", flush=True)
    if "ops" in args.parts:
        result["ops"] = {name: {b: step_ops(narrow, b, sampling) for b in (1, 8, 32)} for name, sampling in SETTINGS.items()}
        print(f"primitives per step (batch 1 / 8 / 32): {json.dumps(result['ops'])}", flush=True)
    if "syncs" in args.parts:
        result["syncs"] = engine_syncs(args.model, clients=8, tokens=8)
        print(f"host syncs on the engine thread: {json.dumps(result['syncs'])}", flush=True)
    if "matmul" in args.parts:
        result["matmul"] = {Path(args.model).name: {b: matmul_share(args.model, b, 128, args.steps) for b in (1, 8)}}
        print(f"matmul share (batch 1, 8): {json.dumps(result['matmul'])}", flush=True)
    result |= {"model": args.model, "layers": args.layers, "load_end": load_average()}
    save(result, args.out / "step_profile.json")


def save(result: dict, path: Path) -> None:
    """Write ``result`` into ``path``, keeping the parts (and other models' matmul shares) of an
    earlier run that this one did not measure."""
    earlier = json.loads(path.read_text()) if path.exists() else {}
    matmul = {**earlier.get("matmul", {}), **result.get("matmul", {})}
    merged = {**earlier, **result} | ({"matmul": matmul} if matmul else {})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merged, indent=2))


if __name__ == "__main__":
    main()
