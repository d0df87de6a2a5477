"""Native MTP speculation: decode tokens/s with and without ``--mtp`` on a random Qwen3.5-shaped
model (3 Gated DeltaNet layers to 1 gated attention layer, Qwen3.5's head sizes) whose
checkpoint carries ``mtp.*`` weights in the hub's layout, written by transformers.

Two heads, the same target cost:
- ``random``: random MTP weights. Its drafts are almost never accepted: the cost of a round
  (the MTP steps and a ``k + 1``-token verification) against plain decoding.
- ``exact``: the mechanism at full acceptance. Every mixer's and MLP's output projection of the
  target is zeroed (same shapes, same cost; its next token then depends on its input token only)
  and the MTP head is made to reproduce it one token ahead (its layer adds nothing, ``fc``
  passes the embedding through, its final norm is the target's), so every draft is accepted.
  Real Qwen3.5 MTP heads are reported to accept most first drafts; the truth lies between.

Greedy output is checked equal to plain decoding for every run. Reported per head and per
``--mtp-tokens``: decode tokens/s (after the first token), the ratio to plain decoding
(interleaved rounds, median), and acceptance. Record ``uptime``'s load beside the figures.

``--bits 4`` quantizes the target and the head (group 64, MLX's affine 4-bit: the regime where
a decode step reads 4-bit weights). ``--profile`` first times where a round's time goes, each
part evaluated on its own (medians): a plain decode step, the ``k + 1``-token verification
forward, the MTP head feeding ``k + 1`` accepted positions, one chained MTP step, one
vocabulary projection and a host sync; the round's predicted speed-up at full acceptance is
``(k + 1) step / (verify + feed + (k - 1) chained + k projections + sync)``. ``--matmul-rows``
only times one matmul against its number of rows (4-bit and float; float32 and bfloat16).

Usage: python benchmarks/mtp.py [--hidden 1024] [--layers 8] [--vocab 32000] [--prompt 128]
       [--tokens 64] [--draft-tokens 1 2 3] [--rounds 3] [--dtype float32] [--dir .bench/models]
       [--bits 4] [--profile]; python benchmarks/mtp.py --matmul-rows
Smoke: python benchmarks/mtp.py --hidden 256 --layers 4 --vocab 4096 --tokens 24 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np


def write_checkpoint(directory: Path, hidden: int, layers: int, vocab: int) -> Path:
    """A random Qwen3.5 text checkpoint with one MTP layer (``mtp.*``) and a word tokenizer."""
    import torch
    from safetensors.numpy import load_file, save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM

    if (directory / "config.json").exists():
        return directory
    shape = dict(hidden_size=hidden, intermediate_size=3 * hidden, vocab_size=vocab, num_attention_heads=max(hidden // 256, 2),
                 num_key_value_heads=1, head_dim=256, linear_num_key_heads=max(hidden // 128, 2),
                 linear_num_value_heads=max(hidden // 64, 4), linear_key_head_dim=128, linear_value_head_dim=128,
                 linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_5_text", num_hidden_layers=layers, **shape)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    layer_config = AutoConfig.for_model("qwen3_5_text", num_hidden_layers=1, layer_types=["full_attention"], **shape)
    source = directory.parent / f"{directory.name}-mtp-layer"
    AutoModelForCausalLM.from_config(layer_config, dtype=torch.float32).save_pretrained(source)
    tensors = load_file(directory / "model.safetensors")
    for name, value in load_file(source / "model.safetensors").items():
        if name.startswith("model.layers.0."):
            tensors["mtp.layers.0." + name[len("model.layers.0."):]] = value
    rng = np.random.default_rng(1)
    tensors["mtp.fc.weight"] = (rng.standard_normal((hidden, 2 * hidden)) * 0.02).astype(np.float32)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = np.zeros(hidden, np.float32)  # (1 + w) norms
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "mtp_num_hidden_layers": 1}))
    words = {f"w{i}": i for i in range(vocab)}
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def make_exact(model, drafter) -> None:
    """The ``exact`` head (see the module docstring), in place."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    def zero_outputs(module) -> None:
        module.update(tree_unflatten([(k, mx.zeros_like(v)) for k, v in tree_flatten(module.parameters())
                                      if k.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight"))]))

    zero_outputs(model)
    head = drafter.head
    zero_outputs(head)
    hidden = model.args.hidden_size
    dtype = head.fc.weight.dtype
    head.fc.weight = mx.concatenate([mx.eye(hidden), mx.zeros((hidden, hidden))], axis=1).astype(dtype)
    head.pre_fc_norm_embedding.weight = mx.zeros((hidden,), dtype)
    head.norm.weight = model.model.norm.weight
    mx.eval(model.parameters(), head.parameters())


def quantize(model, drafter, bits: int) -> None:
    """The target and the MTP head quantized in place (MLX affine, group 64)."""
    import mlx.core as mx
    import mlx.nn as nn

    nn.quantize(model, group_size=64, bits=bits)
    nn.quantize(drafter.head, group_size=64, bits=bits)
    mx.eval(model.parameters(), drafter.head.parameters())


def median_ms(run, repeats: int) -> float:
    """Median wall time of ``run()`` (which evaluates what it times) in ms, after one warm-up."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def profile(model, drafter, prompt: list[int], draft_tokens: list[int], repeats: int = 7) -> None:
    """Where a round's time goes (the module docstring's ``--profile``), at each ``k``."""
    import mlx.core as mx

    from mlxformer.cache import CacheSettings, make_cache
    from mlxformer.generation.steps import decode_step, prefill

    k_max = max(draft_tokens)
    cache = make_cache(model, CacheSettings(rewind=k_max + 1))  # trim(k + 1) exact: every part starts equal
    mx.eval(prefill(model, mx.array(prompt), cache))
    head_cache = make_cache(drafter.head, CacheSettings(rewind=k_max + 1))
    hidden = model.args.hidden_size
    rows = mx.random.normal((1, len(prompt), hidden)) * 0.1
    mx.eval(drafter.head(drafter.embed(mx.array(prompt)[None]), rows.astype(model.model.norm.weight.dtype), head_cache))

    def timed(forward, caches, n: int) -> float:
        def run() -> None:
            mx.eval(forward())
            for c in caches:
                c.trim(n)
        return median_ms(run, repeats)

    token = mx.array([prompt[-1]])
    step = timed(lambda: decode_step(model, token, cache), cache, 1)
    g1 = mx.zeros((1, 1, hidden), model.model.norm.weight.dtype)
    chained = timed(lambda: drafter.head(drafter.embed(token[None]), g1, head_cache), head_cache, 1)
    projection = median_ms(lambda: mx.eval(mx.argmax(model.logits(g1)[:, -1, :], axis=-1)), repeats)
    sync = median_ms(lambda: mx.array([1]).tolist(), repeats)
    print(f"profile (ms, medians of {repeats}) | decode step {step:.1f} | chained MTP step (no projection) "
          f"{chained:.1f} | vocabulary projection + argmax {projection:.1f} | host sync {sync:.3f}")
    for k in draft_tokens:
        ids = mx.array([prompt[-k - 1:]], mx.int32)  # (1, k + 1)
        verify = timed(lambda: model(ids, cache), cache, k + 1)
        feed = timed(lambda: drafter.head(drafter.embed(ids), mx.zeros((1, k + 1, hidden), g1.dtype), head_cache),
                      head_cache, k + 1)
        round_ms = verify + feed + (k - 1) * chained + k * projection + sync
        print(f"profile k={k} | verify {k + 1} tokens {verify:.1f} ({verify / step:.2f} steps) | MTP feed {k + 1} "
              f"{feed:.1f} | round at full acceptance {round_ms:.1f} for {k + 1} tokens vs {(k + 1) * step:.1f} "
              f"plain: predicted {(k + 1) * step / round_ms:.2f}x")


def matmul_rows(shapes=((4096, 2048), (2048, 4096)), rows=(1, 2, 3, 4, 8), repeats: int = 9) -> None:
    """One matmul's time against its number of rows ``M`` (ms, medians): 4-bit (group 64) and
    float, with float32 and bfloat16 activations, at Qwen3.5 sizes. Rows that cost about what one
    row costs make a ``k + 1``-token verification cost about one decode step."""
    import mlx.core as mx

    for n, k in shapes:
        w = 0.02 * mx.random.normal((n, k))
        wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
        for dtype in (mx.float32, mx.bfloat16):
            wd, sd, bd = w.astype(dtype), scales.astype(dtype), biases.astype(dtype)
            cells = []
            for m in rows:
                x = mx.random.normal((m, k)).astype(dtype)
                q = median_ms(lambda: mx.eval(mx.quantized_matmul(x, wq, sd, bd, transpose=True, group_size=64, bits=4)),
                              repeats)
                f = median_ms(lambda: mx.eval(x @ wd.T), repeats)
                cells.append(f"M={m}: 4-bit {q:.1f} / float {f:.1f}")
            print(f"matmul {n}x{k} {dtype} (ms) | " + " | ".join(cells), flush=True)


def decode_run(model, tokenizer, prompt: list[int], tokens: int, speculative) -> tuple[list[int], float, int, int]:
    """(tokens, decode tokens/s after the first, proposed, accepted)."""
    from mlxformer import stream_generate

    out, first, last = [], 0.0, None
    for response in stream_generate(model, tokenizer, prompt, max_tokens=tokens, speculative=speculative):
        out.append(response.token)
        if len(out) == 1:
            first = time.perf_counter()
        last = response
    elapsed = time.perf_counter() - first
    return out, (len(out) - 1) / max(elapsed, 1e-9), last.proposed_tokens, last.accepted_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--draft-tokens", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--dir", default=".bench/models")
    parser.add_argument("--bits", type=int, choices=(4, 8), help="quantize the target and the head")
    parser.add_argument("--profile", action="store_true", help="time a round's parts first")
    parser.add_argument("--matmul-rows", action="store_true", help="only time one matmul against its rows")
    args = parser.parse_args()
    if args.matmul_rows:
        matmul_rows()
        return

    import os

    from mlxformer import load
    from mlxformer.speculative.mtp import load_mtp
    from mlxformer.speculative.speculator import SpeculativeSettings

    directory = write_checkpoint(Path(args.dir) / f"qwen3_5-mtp-h{args.hidden}-l{args.layers}-v{args.vocab}",
                                 args.hidden, args.layers, args.vocab)
    prompt = [int(t) for t in np.random.default_rng(2).integers(1, args.vocab, size=args.prompt)]
    print(f"model {directory.name}, {args.dtype}, {f'{args.bits}-bit' if args.bits else 'float'} weights, "
          f"prompt {args.prompt}, {args.tokens} tokens, "
          f"load average {os.getloadavg()[0]:.1f}")
    for head in ("random", "exact"):
        model, tokenizer = load(directory, dtype=args.dtype)
        drafter = load_mtp(directory, model)
        if head == "exact":
            make_exact(model, drafter)
        if args.bits:
            quantize(model, drafter, args.bits)
        if args.profile and head == "random":
            profile(model, drafter, prompt, args.draft_tokens)
        plain_tps: list[float] = []
        runs: dict[int, list[tuple[float, int, int]]] = {k: [] for k in args.draft_tokens}
        decode_run(model, tokenizer, prompt, 4, None)  # warm up
        for _ in range(args.rounds):
            expected, tps, _, _ = decode_run(model, tokenizer, prompt, args.tokens, None)
            plain_tps.append(tps)
            for k in args.draft_tokens:
                settings = SpeculativeSettings(mtp=drafter, num_draft_tokens=k)
                got, tps, proposed, accepted = decode_run(model, tokenizer, prompt, args.tokens, settings)
                assert got == expected, f"--mtp-tokens {k} changed the greedy output"
                runs[k].append((tps, proposed, accepted))
        plain = statistics.median(plain_tps)
        print(f"{head:>6} head | plain decode {plain:7.2f} tok/s")
        for k, rows in runs.items():
            tps = statistics.median(r[0] for r in rows)
            proposed, accepted = sum(r[1] for r in rows), sum(r[2] for r in rows)
            print(f"{head:>6} head | --mtp-tokens {k}: {tps:7.2f} tok/s ({tps / plain:.2f}x plain), "
                  f"accepted {accepted}/{proposed} ({accepted / max(proposed, 1):.0%})")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
