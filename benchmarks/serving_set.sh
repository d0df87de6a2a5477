#!/usr/bin/env bash
# The serving set of issue 32, for a quiet machine: `mlxformer serve` beside `mlx_lm.server`
# (1 and 8 concurrent clients on SmolLM2 float32, bfloat16 and 4-bit, and 2 and 4 on bfloat16 for
# the plot; head-of-line behind a 3,000-token prompt), the KV budget sized for two requests, and
# the engine's step profile; then 1 and 8 clients again with `--threads 1` (one CPU stream, as
# mlx-lm). 42 minutes on 2 idle x86 cores (2026-12-02; the head-of-line
# part's two 3,000-token prefills are 14 of them); results in benchmarks/results/ (JSON,
# serve_throughput.png), each part's time printed.
#
#   bash benchmarks/serving_set.sh            # everything
#   bash benchmarks/serving_set.sh --smoke    # small sizes, results in /tmp/serving_set (a few minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
[ -d .bench/models/smollm2-4bit ] && [ -d .bench/models/tiny-smollm2 ] || python benchmarks/prepare_models.py --skip-1b
if [ "${1:-}" = "--smoke" ]; then
  out=/tmp/serving_set
  clients=(--models smollm2-bf16 --ends-only --clients 1 2 --max-tokens 8 --skip-single)
  one_stream=(--models smollm2-bf16 --ends-only --clients 1 2 --max-tokens 8 --skip-single)
  tiny=(--models tiny-smollm2 --ends-only --clients 1 8 --max-tokens 16 --skip-single)
  hol=(--model smollm2-bf16 --long 600 --trials 1 --max-tokens 2)
  kv=(--model smollm2-bf16 --prompt-tokens 300 --max-tokens 16)
  step=(--context 4096 --steps 3)
else
  out=benchmarks/results
  clients=(--models smollm2-bf16 --ends-only smollm2-f32 smollm2-4bit --clients 1 2 4 8 --max-tokens 32)
  one_stream=(--models smollm2-f32 --ends-only smollm2-bf16 --clients 1 8 --max-tokens 32 --skip-single)
  tiny=(--models tiny-smollm2 --ends-only --clients 1 8 --max-tokens 128 --skip-single)
  hol=(--model smollm2-bf16 --long 3000 --trials 1)
  kv=(--model smollm2-bf16 --prompt-tokens 1000 --max-tokens 64)
  step=(--context 32768 --steps 5)
fi
uptime
time python benchmarks/serve_vs_mlx_lm.py "${clients[@]}" --out "$out"
# the same with our projections on one CPU stream (mlx-lm's setting): whether the default split
# over 2 streams pays on this machine (it does not on a busy one: docs/design/server.md, section 3)
time python benchmarks/serve_vs_mlx_lm.py "${one_stream[@]}" --first mlx-lm --out "$out/threads1" --ours=--threads=1
# a 2-layer random model with SmolLM2's tokenizer: the servers' own per-token cost (a forward of a few ms)
time python benchmarks/serve_vs_mlx_lm.py "${tiny[@]}" --out "$out/tiny"
time python benchmarks/serve_vs_mlx_lm.py "${tiny[@]}" --first mlx-lm --out "$out/tiny_threads1" --ours=--threads=1
time python benchmarks/handoffs.py --model .bench/models/tiny-smollm2 | tee "$out/handoffs.txt"
time python benchmarks/serve_head_of_line.py "${hol[@]}" --out "$out"
time python benchmarks/serve_kv_budget.py "${kv[@]}" --out "$out" || echo "serve_kv_budget: a request was refused (see $out/serve_kv_budget.json)"
time python benchmarks/step_profile.py --model .bench/models/smollm2-f32 "${step[@]}" --out "$out"
uptime
