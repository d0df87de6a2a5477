"""Hybrid Gated DeltaNet (Qwen3.5-MoE-shaped) model: mlxformer beside mlx-lm on the same files.

``--write DIR`` makes DIR/float (bfloat16), DIR/q4 (4-bit, mlx-lm's ``convert``, its 8-bit
router gates; bfloat16 scales) and DIR/q4-f32 (the same with float32 scales and other weights,
for the CPU conversation) in the mlx-community layout, both built by mlx-lm's own ``qwen3_5_moe`` model with
random weights: Qwen3.5-35B-A3B's head sizes (hidden 2048; attention 16 query / 2 key-value heads
of 256, a quarter rotated, output gate; Gated DeltaNet 16 key / 32 value heads of 128, conv 4;
``--experts`` routed experts of 512, top 8, a shared expert of 512), ``--layers`` layers at 3
DeltaNet : 1 attention, a ``--vocab`` vocabulary and a byte tokenizer with a ChatML template.

``speed``: prefill and decode tok/s of each runtime on each dir, every trial in its own
subprocess, A B / B A interleaved (greedy, no eos; prefill = prompt tokens over the time to
the first token, decode = the rest per token), medians and the ratios.

``conversation``: a 4-turn agent conversation through each server (`mlxformer serve`, then
`mlx_lm.server`, one at a time on 127.0.0.1): a ``--prefix-tokens`` system prompt and a first
user message, then each turn generates a ``--reply-tokens`` reply and the next turn sends it back
verbatim with a new user message (``--turn-tokens`` added a turn in all; the byte tokenizer makes
a character a token). The random model's replies are held to tokens that round-trip (a
``logit_bias`` of +100 on the printable non-space ASCII bytes, the same request to both servers),
so the history carries exactly the ids each server generated, as a real agent's does; both
servers see the chat API as an agent uses it (template, tokenizer, and mlx_lm.server's own
segment and end-of-generation cache entries). The token-id form of /v1/completions would not be
fair: mlx_lm.server's completions take text only. TTFT (first content token, greedy) of each
turn, turns 2-4 as a fraction of turn 1 (the cold prefill), the cached prompt tokens each server
reports (``usage.prompt_tokens_details``), and for mlxformer the hit ratio ``/metrics`` reports.

Usage (the full run on a quiet machine; results to benchmarks/results/hybrid_cpu.md):
  python benchmarks/hybrid.py --write .bench/qwen35-moe-shaped --layers 4 --experts 64 --vocab 32000
  python benchmarks/hybrid.py speed --model-dir .bench/qwen35-moe-shaped --trials 2 --prompt-tokens 512
  python benchmarks/hybrid.py conversation --model-dir .bench/qwen35-moe-shaped/q4-f32 --prefix-tokens 4096 --turn-tokens 500 --reply-tokens 100
  (on a Mac the float or q4 dir; on the CPU q4-f32: mlx_lm.server cannot run the float dir's bfloat16
  experts there, MLX's CPU gather_mm being float32-only, and runs the q4 dir in bfloat16, 9-40x slower)
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

sys.path.insert(0, str(Path(__file__).parent))

from gpt_oss import write_byte_tokenizer  # noqa: E402  (benchmarks/ is not a package)
from serving import Server, load_average  # noqa: E402

RUNTIMES = ("mlxformer", "mlx-lm")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = "read edit grep test build plan diff patch shell error trace module config path".split()


def qwen35_moe_config(layers: int, experts: int, vocab: int) -> dict:
    """Qwen3.5-35B-A3B's text config values, with ``layers`` layers, ``experts`` experts, ``vocab``."""
    return {
        "model_type": "qwen3_5_moe", "hidden_size": 2048, "num_hidden_layers": layers,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "rms_norm_eps": 1e-6,
        "vocab_size": vocab, "max_position_embeddings": 262144, "tie_word_embeddings": False,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "num_experts": experts, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "norm_topk_prob": True,
        "intermediate_size": 512, "attn_output_gate": True, "hidden_act": "silu", "eos_token_id": 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10]},
    }


def write_model(directory: Path, layers: int, experts: int, vocab: int) -> None:
    """DIR/float: mlx-lm's qwen3_5_moe with random bfloat16 weights (std 0.02, norms 1, decays as
    initialised); DIR/q4: mlx-lm's ``convert`` of it to 4 bits."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import convert
    from mlx_lm.models.qwen3_5_moe import Model, ModelArgs
    from mlx_lm.utils import save_config, save_model

    config = qwen35_moe_config(layers, experts, vocab)
    model = Model(ModelArgs.from_dict(config))
    weights = {}
    for i, (name, value) in enumerate(tree_flatten(model.parameters())):
        if name.endswith(("norm.weight", "A_log", "dt_bias")):
            weights[name] = value.astype(mx.bfloat16)  # mlx-lm's init: norms 1, decay parameters
        else:
            weights[name] = (0.02 * mx.random.normal(value.shape, key=mx.random.key(i))).astype(mx.bfloat16)
    model.load_weights(list(weights.items()))
    float_dir = directory / "float"
    float_dir.mkdir(parents=True, exist_ok=True)
    save_model(float_dir, model)
    save_config(config, float_dir / "config.json")
    write_byte_tokenizer(float_dir)
    add_chat_tokens(float_dir)
    convert(str(float_dir), str(directory / "q4"), quantize=True, q_group_size=64, q_bits=4)
    # the same 4 bits with float32 scales and other weights: on the CPU, where MLX's quantized
    # matmul is 9-40x slower with 16-bit activations, mlx-lm then computes in float32 as mlxformer does
    convert(str(float_dir), str(directory / "q4-f32"), quantize=True, q_group_size=64, q_bits=4, dtype="float32")


def add_chat_tokens(directory: Path) -> None:
    """The ChatML template, its markers as special tokens (one token each, as in Qwen's
    tokenizer, not 12 bytes: a turn's template then costs what it costs a real model)."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")])
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": CHATML}))


def worker(runtime: str, model_dir: str, prompt_tokens: int, generation_tokens: int) -> None:
    """One trial in this process: its JSON."""
    import mlx.core as mx

    from mlxformer.tools.bench import measure, mlxformer_loop, random_prompt

    # On the CPU both runtimes compute in float32: MLX's gather_mm (float experts) is float32-only
    # there, and its quantized_matmul is ~10x slower with bfloat16 activations (mlxformer's CPU
    # dtype policy picks float32 for a quantized model by itself; mlx-lm's bfloat16 default
    # would make the 4-bit comparison one of dtypes, not runtimes)
    on_cpu = mx.default_device() == mx.cpu
    cast = on_cpu and "quantization" not in json.loads((Path(model_dir) / "config.json").read_text())
    if runtime == "mlxformer":
        from mlxformer import load

        model, _ = load(model_dir, dtype=mx.float32) if cast else load(model_dir)
        loop = mlxformer_loop(model)
    else:
        from mlx_lm import load as mlx_lm_load
        from vs_mlx_lm import mlx_lm_loop  # benchmarks/ is the script's directory

        model, _ = mlx_lm_load(model_dir)
        if on_cpu:
            model.set_dtype(mx.float32)  # float parameters and quantization scales

        loop = mlx_lm_loop(model)

    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    measure(loop, random_prompt(vocab, 16, seed=1), 4)  # warm-up
    print(json.dumps(measure(loop, random_prompt(vocab, prompt_tokens), generation_tokens).__dict__))


def run_trial(runtime: str, model_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, __file__, "--worker", runtime, "--model-dir", str(model_dir),
               "--prompt-tokens", str(args.prompt_tokens), "--generation-tokens", str(args.generation_tokens)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{runtime} trial on {model_dir} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def speed(args: argparse.Namespace) -> None:
    import mlx.core as mx

    config = json.loads((args.model_dir / "float" / "config.json").read_text())
    print(f"# {date.today()} | {platform.machine()} {platform.system()} | MLX {mx.__version__} | device "
          f"{mx.default_device()} | Qwen3.5-MoE-shaped, {config['num_hidden_layers']} layers (3:1), "
          f"{config['num_experts']} experts | prompt {args.prompt_tokens} tok, generate {args.generation_tokens} tok, "
          f"{args.trials} interleaved trials, medians | load {load_average()}")
    print("| weights | runtime | prefill tok/s | decode tok/s | peak GB | prefill × | decode × | memory × |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.weights:
        results: dict[str, list[dict[str, float]]] = {r: [] for r in RUNTIMES}
        for trial in range(args.trials):
            for runtime in RUNTIMES if trial % 2 == 0 else RUNTIMES[::-1]:
                results[runtime].append(run_trial(runtime, args.model_dir / name, args))
        keys = ("prefill_tps", "decode_tps", "peak_memory_gb")
        medians = {r: {k: statistics.median(t[k] for t in trials) for k in keys} for r, trials in results.items()}
        ours, theirs = medians["mlxformer"], medians["mlx-lm"]
        for runtime in RUNTIMES:
            m = medians[runtime]
            ratios = (f"{ours['prefill_tps'] / theirs['prefill_tps']:.2f} | {ours['decode_tps'] / theirs['decode_tps']:.2f} | "
                      f"{ours['peak_memory_gb'] / theirs['peak_memory_gb']:.2f}") if runtime == "mlxformer" else " | | "
            print(f"| {name} | {runtime} | {m['prefill_tps']:.1f} | {m['decode_tps']:.2f} | {m['peak_memory_gb']:.3f} | "
                  f"{ratios} |", flush=True)
    print(f"load after: {load_average()}")


def text(tokens: int, seed: int) -> str:
    """About ``tokens`` tokens of text (one a character), different for each seed."""
    words, n = [], 0
    while n < tokens:
        word = WORDS[(n * 7 + seed * 13) % len(WORDS)]
        words.append(word)
        n += len(word) + 1
    return f"[{seed}] " + " ".join(words)[: max(0, tokens - 5)]


def round_trip_bias(model_dir: Path) -> dict[str, float]:
    """``logit_bias`` (+100) for the tokens that are one printable ASCII character other than a
    space: a reply made of them re-tokenizes to itself, whatever the random weights pick."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    allowed = [i for i in range(tokenizer.get_vocab_size()) if len(piece := tokenizer.decode([i])) == 1
               and "!" <= piece <= "~" and tokenizer.encode(piece).ids == [i]]
    return {str(i): 100.0 for i in allowed}


def conversation(server: Server, args: argparse.Namespace) -> dict:
    """TTFT of each turn of one conversation, the prompt tokens each server reports cached, and
    (mlxformer) the hit ratio after it. Each turn generates a ``--reply-tokens`` reply (greedy,
    its tokens held to ones that round-trip: ``round_trip_bias``) and the next turn sends it back
    verbatim, as an agent does, with a new user message: ``--turn-tokens`` added a turn."""
    bias = round_trip_bias(args.model_dir)
    server.stream_chat([{"role": "user", "content": "hi"}], 1)  # warm-up
    messages = [{"role": "system", "content": text(args.prefix_tokens, 0)},
                {"role": "user", "content": text(args.turn_tokens, 1)}]
    ttfts, cached, prompts = [], [], []
    for turn in range(args.turns):
        result = server.stream_chat(messages, args.reply_tokens, logit_bias=bias)
        usage = result.get("usage") or {}
        ttfts.append(result["ttft"])
        prompts.append(usage.get("prompt_tokens"))
        cached.append((usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
        reply = result["text"]  # the agent's history keeps the reply verbatim
        if len(reply) != result["tokens"]:
            raise SystemExit(f"{server.kind}: a {result['tokens']}-token reply came back as {len(reply)} characters")
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": text(args.turn_tokens - args.reply_tokens, 2 + turn)}]
    return {"ttft": ttfts, "later / cold": [t / ttfts[0] for t in ttfts[1:]], "prompt_tokens": prompts,
            "cached_tokens": cached, "hit_ratio": server.metric("mlxformer_prefix_cache_hit_ratio"),
            "load": load_average()}


def conversations(args: argparse.Namespace) -> None:
    record: dict = {"model": args.model_dir.name, "prefix_tokens": args.prefix_tokens, "turn_tokens": args.turn_tokens}
    for kind in args.servers:
        with Server(kind, args.model_dir) as server:
            record[kind] = conversation(server, args)
        print(f"{kind}: {json.dumps(record[kind])}", flush=True)
    print(json.dumps(record, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=("speed", "conversation"))
    parser.add_argument("--write", type=Path, help="write the shaped model dirs here and exit")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--model-dir", type=Path, default=Path(".bench/qwen35-moe-shaped"))
    parser.add_argument("--weights", nargs="+", default=["float", "q4"], help="speed: the dirs under --model-dir")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--generation-tokens", type=int, default=32)
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--turn-tokens", type=int, default=500)
    parser.add_argument("--reply-tokens", type=int, default=100)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--servers", nargs="+", choices=RUNTIMES, default=list(RUNTIMES), help="conversation: which to run")
    parser.add_argument("--worker", choices=RUNTIMES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write:
        write_model(args.write, args.layers, args.experts, args.vocab)
    elif args.worker:
        worker(args.worker, str(args.model_dir), args.prompt_tokens, args.generation_tokens)
    elif args.mode == "speed":
        speed(args)
    elif args.mode == "conversation":
        conversations(args)
    else:
        parser.error("give --write DIR, or a mode: speed or conversation")


if __name__ == "__main__":
    main()
