"""`mlxformer serve --max-kv-memory` sized for two requests: do two such requests run at once?

The budget is two requests' KV plus one block each: ``2 x (tokens + block) x bytes per token``,
where a request's tokens are its prompt (counted with the chat template) and ``--max-tokens``
generated ones, and the bytes per token are ``2 x layers x KV heads x head dim x dtype bytes``
from config.json (what a user would compute). On one server with that budget (and its other
defaults), two such requests are sent at once (greedy, EOS biased away), then each alone.
Reported: whether both were admitted (no 400) and ran at once (the engine's
``mlxformer_running_sequences`` reached 2 and the two streams overlapped), preemptions, whether
each reply equals the one it gets alone, and the server's peak RSS growth over its RSS after
start-up and a one-token warm-up (the weights), against the budget (issue 32: within 10%).

Usage: python benchmarks/serve_kv_budget.py [--model smollm2-bf16] [--prompt-tokens 1300] [--max-tokens 100]
"""

from __future__ import annotations

import argparse
import functools
import json
from datetime import date
from pathlib import Path

from serving import Server, Watcher, concurrently, eos_ids_of, load_average, text_of_tokens

GAUGES = ("mlxformer_running_sequences", "mlxformer_kv_bytes_used", "mlxformer_mlx_active_bytes",
          "mlxformer_mlx_cache_bytes", "mlxformer_preemptions_total", "mlxformer_step_reserve_bytes")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(model_dir: Path, dtype: str | None) -> int:
    """K and V bytes of one token over every layer, from config.json (``dtype``: the cache's)."""
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    dtype = dtype or config.get("torch_dtype") or config.get("dtype") or "float32"
    return 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * DTYPE_BYTES[dtype]


def prompt_tokens(model_dir: Path, messages: list[dict[str, str]]) -> int:
    """Tokens of ``messages`` after the chat template (transformers' count)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def save(result: dict, out: Path) -> None:
    """Print ``result`` and write it to ``out/serve_kv_budget.json``."""
    print(json.dumps(result, indent=2))
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_kv_budget.json").write_text(json.dumps(result, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models-dir", type=Path, default=Path(".bench/models"))
    parser.add_argument("--model", default="smollm2-bf16")
    parser.add_argument("--prompt-tokens", type=int, default=1300)
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--block", type=int, default=256, help="the engine's KV block, tokens")
    parser.add_argument("--kv-dtype", choices=sorted(DTYPE_BYTES), default=None,
                        help="the KV cache's dtype (default: the checkpoint's)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    model_dir = args.models_dir / args.model
    prompts = [[{"role": "user", "content": "Summarize: " + text_of_tokens(model_dir, args.prompt_tokens, seed=s)}]
               for s in (1, 2)]
    tokens = max(prompt_tokens(model_dir, p) for p in prompts) + args.max_tokens
    per_token = kv_bytes_per_token(model_dir, args.kv_dtype)
    budget = 2 * (tokens + args.block) * per_token
    print(f"{args.model}: {tokens} tokens per request x {per_token} B per token; budget {budget} B "
          f"({budget / 2**20:.1f} MiB)", flush=True)
    bias = {str(i): -100.0 for i in eos_ids_of(model_dir)}
    start_load = load_average()
    result: dict = {"date": str(date.today()), "model": args.model, "tokens_per_request": tokens,
                    "kv_bytes_per_token": per_token, "budget": budget, "load_start": start_load}
    with Server("mlxformer", model_dir, ["--max-kv-memory", str(budget)]) as server:
        server.stream_chat([{"role": "user", "content": "Hello"}], 1)  # warm-up
        rest = server.rss()[0]
        server.reset_peak_rss()
        replies = [functools.partial(server.stream_chat, p, args.max_tokens, logit_bias=bias) for p in prompts]
        try:
            with Watcher(server, GAUGES) as watched:
                together = concurrently(replies)
        except SystemExit as refused:  # a 400: the budget turned a request away
            save(result | {"refused": str(refused)}, args.out)
            raise
        peak = server.rss()[1]
        alone = [reply() for reply in replies]
    first, second = sorted(together, key=lambda r: r["start"])
    result |= {
        "running_peak": watched.peaks.get("mlxformer_running_sequences"),
        "streams_overlap": second["ttft"] + second["start"] < first["end"],
        "preemptions": watched.peaks.get("mlxformer_preemptions_total"),
        "replies_equal_alone": [t["text"] == a["text"] for t, a in zip(together, alone)],
        "generated": [t["tokens"] for t in together],
        "kv_bytes_used_peak": watched.peaks.get("mlxformer_kv_bytes_used"),
        "mlx_active_peak": watched.peaks.get("mlxformer_mlx_active_bytes"),
        "mlx_cache_peak": watched.peaks.get("mlxformer_mlx_cache_bytes"),
        "rss_after_warmup": rest, "rss_peak": peak, "rss_growth_mib": round((peak - rest) / 2**20, 1),
        "budget_mib": round(budget / 2**20, 1), "rss_growth_over_budget": round((peak - rest) / budget, 3),
        # a step's activations the server allows beside the KV (and MLX's buffer cache limit)
        "step_reserve_mib": round(watched.peaks.get("mlxformer_step_reserve_bytes", 0) / 2**20, 1),
        # MLX keeps freed buffers for reuse (its cache, in the RSS): the growth without its peak
        "rss_growth_less_mlx_cache_over_budget": round((peak - rest - watched.peaks.get("mlxformer_mlx_cache_bytes", 0)) / budget, 3),
        "rss_sampled_peak": watched.peaks["rss"], "ttfts": [t["ttft"] for t in together], "load_end": load_average(),
    }
    save(result, args.out)


if __name__ == "__main__":
    main()
