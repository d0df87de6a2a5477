"""Multi-head latent attention: mlxformer beside mlx-lm on one GLM-4.7-Flash-shaped MoE checkpoint.

The checkpoint (``--write``) has GLM-4.7-Flash's real head sizes and ranks (hidden 2048, 20 heads,
q_lora_rank 768, kv_lora_rank 512, qk_nope 192, qk_rope 64, v_head 256, 64 routed experts of
1536 with top-4 and one shared expert, vocabulary 154880) but few layers (the first dense) and
random bfloat16 weights, saved once in a layout both runtimes load (stacked ``switch_mlp``
experts, the HF ``kv_b_proj``). Each trial runs in its own subprocess, A B / B A interleaved:
prefill speed is prompt tokens over the time to the first token, decode speed the remaining
tokens over their time (greedy, no eos). KV bytes are what each runtime's caches hold after a
``--kv-context``-token prefill (both store the latent and the rope key, mlx-lm in its own
MLA layer; expanded K/V would be ``heads * (nope + rope + v)`` per token and layer).

Usage:
  python benchmarks/mla.py --write .bench/glm47-flash-shaped [--layers 3 --experts 64]
  python benchmarks/mla.py --model-dir .bench/glm47-flash-shaped [--trials 3 --prompt-tokens 512]
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

RUNTIMES = ("mlxformer", "mlx-lm")


VOCAB = 154880  # GLM-4.7-Flash's vocabulary


def flash_config(layers: int, experts: int, vocab: int = VOCAB) -> dict:
    """GLM-4.7-Flash's config.json values, with ``layers`` layers, ``experts`` routed experts and
    ``vocab`` tokens (not a head size or rank: a smaller one only shortens the embedding and the
    output projection)."""
    return {
        "model_type": "glm4_moe_lite", "architectures": ["Glm4MoeLiteForCausalLM"],
        "hidden_size": 2048, "num_attention_heads": 20, "num_key_value_heads": 20,
        "q_lora_rank": 768, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
        "intermediate_size": 10240, "moe_intermediate_size": 1536, "n_routed_experts": experts, "n_shared_experts": 1,
        "num_experts_per_tok": 4, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.8, "norm_topk_prob": True,
        "first_k_dense_replace": 1, "num_hidden_layers": layers, "vocab_size": vocab, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0, "rope_interleave": True, "max_position_embeddings": 202752, "attention_bias": False,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
    }


def write_checkpoint(directory: Path, layers: int, experts: int, vocab: int = VOCAB) -> None:
    """Random bfloat16 weights (std 0.02, norms 1) of the shaped model, as one safetensors file."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxformer.models.config import ModelArgs
    from mlxformer.models.decoder import Model

    config = flash_config(layers, experts, vocab)
    model = Model(ModelArgs.from_dict(config))
    weights = {}
    for i, (name, value) in enumerate(tree_flatten(model.parameters())):
        if name.endswith("norm.weight"):
            weights[name] = mx.ones(value.shape, mx.bfloat16)
        elif name.endswith("e_score_correction_bias"):
            weights[name] = mx.zeros(value.shape, mx.float32)
        else:
            weights[name] = (0.02 * mx.random.normal(value.shape, key=mx.random.key(i))).astype(mx.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    from tokenizers import Tokenizer, models  # a byte tokenizer: mlxformer's load wants one; prompts are random ids

    Tokenizer(models.BPE(vocab={chr(i): i for i in range(256)}, merges=[])).save(str(directory / "tokenizer.json"))


def worker(runtime: str, model_dir: str, prompt_tokens: int, generation_tokens: int, kv_context: int) -> None:
    """One trial in this process: its JSON (speeds, peak memory, KV bytes after ``kv_context`` tokens)."""
    import mlx.core as mx

    from mlxformer.tools.bench import measure, mlxformer_loop, random_prompt

    if runtime == "mlxformer":
        from mlxformer import load
        from mlxformer.cache import make_cache
        from mlxformer.generation.steps import prefill

        model, _ = load(model_dir)
        loop = mlxformer_loop(model)

        def kv_bytes(prompt: mx.array) -> int:
            cache = make_cache(model)
            mx.eval(prefill(model, prompt, cache))
            return sum(c.nbytes for c in cache)
    else:
        from vs_mlx_lm import mlx_lm_loop  # benchmarks/ is the script's directory
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm.utils import load_model

        model, _ = load_model(Path(model_dir))
        if mx.default_device() == mx.cpu:  # mlx-lm's gather_mm is float32-only on the CPU (mlxformer's policy casts too)
            model.set_dtype(mx.float32)

        loop = mlx_lm_loop(model)

        def kv_bytes(prompt: mx.array) -> int:
            # as generate_step prefills: chunks of its default 2048 tokens, only the cache evaluated
            # (the chunk's logits stay lazy, never computed)
            cache = make_prompt_cache(model)
            for start in range(0, prompt.size, 2048):
                model(prompt[None, start : start + 2048], cache=cache)
                mx.eval([c.state for c in cache])
            return sum(c.nbytes for c in cache)

    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    measure(loop, random_prompt(vocab, 16, seed=1), 4)  # warm-up
    trial = measure(loop, random_prompt(vocab, prompt_tokens), generation_tokens).__dict__
    trial["kv_bytes"] = kv_bytes(random_prompt(vocab, kv_context, seed=2))
    print(json.dumps(trial))


def run_trial(runtime: str, args: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, __file__, "--worker", runtime, "--model-dir", str(args.model_dir),
               "--prompt-tokens", str(args.prompt_tokens), "--generation-tokens", str(args.generation_tokens),
               "--kv-context", str(args.kv_context)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{runtime} trial failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", type=Path, help="write the shaped checkpoint here and exit")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary of the written checkpoint")
    parser.add_argument("--model-dir", type=Path, default=Path(".bench/glm47-flash-shaped"))
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--generation-tokens", type=int, default=32)
    parser.add_argument("--kv-context", type=int, default=4096)
    parser.add_argument("--worker", choices=RUNTIMES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write:
        write_checkpoint(args.write, args.layers, args.experts, args.vocab)
        return
    if args.worker:
        worker(args.worker, str(args.model_dir), args.prompt_tokens, args.generation_tokens, args.kv_context)
        return

    import mlx.core as mx

    config = json.loads((args.model_dir / "config.json").read_text())
    layers = config["num_hidden_layers"]
    expanded = layers * config["num_attention_heads"] * (192 + 64 + 256) * 2 * args.kv_context
    print(f"# {date.today()} | {platform.machine()} {platform.system()} | MLX {mx.__version__} | "
          f"device {mx.default_device()} | GLM-4.7-Flash-shaped, {layers} layers, {config['n_routed_experts']} experts | "
          f"prompt {args.prompt_tokens} tok, generate {args.generation_tokens} tok, {args.trials} interleaved trials, "
          f"medians | KV after {args.kv_context} tokens (expanded bf16 K/V would be {expanded / 2**20:.1f} MiB)")
    print("| runtime | prefill tok/s | decode tok/s | peak GB | KV MiB | KV B/token/layer | prefill × | decode × | KV × |")
    print("|---|---|---|---|---|---|---|---|---|")
    results: dict[str, list[dict[str, float]]] = {r: [] for r in RUNTIMES}
    for trial in range(args.trials):
        for runtime in RUNTIMES if trial % 2 == 0 else RUNTIMES[::-1]:
            results[runtime].append(run_trial(runtime, args))
    keys = ("prefill_tps", "decode_tps", "peak_memory_gb", "kv_bytes")
    medians = {r: {k: statistics.median(t[k] for t in trials) for k in keys} for r, trials in results.items()}
    ours, theirs = medians["mlxformer"], medians["mlx-lm"]
    for runtime in RUNTIMES:
        m = medians[runtime]
        ratios = (f"{ours['prefill_tps'] / theirs['prefill_tps']:.2f} | {ours['decode_tps'] / theirs['decode_tps']:.2f} | "
                  f"{ours['kv_bytes'] / theirs['kv_bytes']:.2f}") if runtime == "mlxformer" else " | | "
        per_token = m["kv_bytes"] / args.kv_context / layers
        print(f"| {runtime} | {m['prefill_tps']:.1f} | {m['decode_tps']:.2f} | {m['peak_memory_gb']:.2f} | "
              f"{m['kv_bytes'] / 2**20:.1f} | {per_token:.0f} | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
