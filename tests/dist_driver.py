"""Run by ``mlx.launch`` from tests/test_distributed.py: each job loads a model across the
ranks and generates greedily from token ids; rank 0 appends one JSON line per job to the
output file, and every rank reports its peak memory while loading."""

from __future__ import annotations

import json
import sys

import mlx.core as mx


def run_job(job: dict) -> dict:
    from mlxformer.cache import CacheSettings, make_cache
    from mlxformer.distributed.pipeline import serve_stage
    from mlxformer.distributed.runner import load_distributed
    from mlxformer.errors import MlxformerError
    from mlxformer.generation.decoding import DecodingState
    from mlxformer.generation.stream import decode

    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    if job["parallel"] == "single":  # the single-process load, on rank 0 only
        if mx.distributed.init().rank() == 0:
            from pathlib import Path

            from mlxformer.loader import build_model, read_checkpoint

            model = build_model(*read_checkpoint(Path(job["model"]))[:2])
            mx.eval(model.parameters())
            return {"load_peaks": [mx.get_peak_memory() - base]}
        return {}
    try:
        dist = load_distributed(job["model"], job["parallel"], timeout=120, with_tokenizer=False)
    except MlxformerError as exc:
        return {"error": str(exc)}
    load_peak = mx.get_peak_memory() - base
    peaks = mx.distributed.all_gather(mx.array([load_peak], dtype=mx.float32), group=dist.group).tolist()
    settings = CacheSettings(**job.get("cache", {}))
    if dist.parallel == "pipeline" and not dist.leader:
        serve_stage(dist.model, dist.group, dist.watchdog, settings)
        return {}
    cache = make_cache(dist.model, settings)
    if job.get("prefill_step"):  # the last logits of a prompt prefilled in chunks of that size
        from mlxformer.generation.steps import prefill

        logits = prefill(dist.model, mx.array(job["prompt"]), cache, job["prefill_step"])[0]
        if dist.link is not None:
            dist.link.stop()
        return {"logits": logits.astype(mx.float32).tolist()}
    state = DecodingState(job["prompt"], max_tokens=job["max_tokens"], cache=cache)  # greedy, eos not checked
    tokens = [token for token, _ in decode(dist.model, state)]
    if dist.link is not None:
        dist.link.stop()
    stage = dist.stage
    return {"tokens": tokens, "load_peaks": peaks, "stage": None if stage is None else [stage.start, stage.stop]}


def main() -> None:
    jobs_path, out_path = sys.argv[1], sys.argv[2]
    mx.set_default_device(mx.cpu)
    jobs = json.loads(open(jobs_path).read())
    rank = mx.distributed.init(strict=True).rank()
    for job in jobs:
        result = run_job(job)
        if rank == 0:
            with open(out_path, "a") as f:
                f.write(json.dumps({"name": job["name"], **result}) + "\n")


if __name__ == "__main__":
    main()
