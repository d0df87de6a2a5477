"""The decode step at which prefilled rows join the batch (issue 32, "KV in one place"): its
time and MLX's peak memory over what was held before, beside a steady decode step, for the old
path (rows prefilled in their own caches, copied into the batch at their first decode step) and
rows seated at admission (``cache/pool.py``: prefilled in their batch row, nothing copied).

    python benchmarks/zero_copy_join.py --rows 4 --tokens 1500 [--staged]
    python benchmarks/zero_copy_join.py --rows 4 --tokens 1500 --max-kv-size 512  # rotating rows
    python benchmarks/zero_copy_join.py --mla --max-kv-size 512     # an MLA model's ring rows
    python benchmarks/zero_copy_join.py --hybrid --max-kv-size 512  # a hybrid's ring and recurrent rows

``--staged``: as under a KV budget (``BatchRunner.staged``: every rewrite one layer at a time,
the seated rows widened before each chunk as ``Admission.grow`` does).

A random Llama with SmolLM2-135M's attention shape (9 heads, 3 KV heads of 64) and ``--layers``
layers, float32 on the CPU; the figures are the fastest of ``--repeats`` runs. ``--hybrid``: a
random Qwen3.5 of the same widths whose layers alternate Gated DeltaNet (3 key heads, 6 value
heads of 64) and attention (its recurrent states in the rows too: ``cache/state_rows.py``).
``--mla``: a random DeepSeek-V3 of the same hidden size (multi-head latent attention: 9 heads,
a latent of 256 and a rope key of 32 per token; dense MLPs), its latents in the rows."""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import mlx.core as mx


def random_model(directory: str, layers: int, hybrid: bool, mla: bool = False):
    """A random Llama (or Qwen3.5, or DeepSeek-V3) of SmolLM2-135M's widths saved with
    transformers, loaded by mlxformer."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM,
                              Qwen3_5ForCausalLM, Qwen3_5TextConfig)

    from mlxformer import load

    torch.manual_seed(0)
    widths = dict(vocab_size=4096, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192)
    if hybrid:
        config = Qwen3_5TextConfig(**widths, head_dim=64, layer_types=["linear_attention", "full_attention"] * (layers // 2),
                                   linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=64,
                                   linear_value_head_dim=64, linear_conv_kernel_dim=4)
        Qwen3_5ForCausalLM(config).save_pretrained(directory)
    elif mla:
        config = DeepseekV3Config(**{**widths, "num_key_value_heads": 9}, kv_lora_rank=256, q_lora_rank=None,
                                  qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, first_k_dense_replace=layers)
        DeepseekV3ForCausalLM(config).save_pretrained(directory)
    else:
        LlamaForCausalLM(LlamaConfig(**widths)).save_pretrained(directory)
    Tokenizer(models.BPE(vocab={chr(i): i for i in range(256)}, merges=[])).save(os.path.join(directory, "tokenizer.json"))
    return load(directory, dtype=mx.float32)[0]


class Row:
    def __init__(self, cache: list, last: int) -> None:
        self.cache, self.speculator, self.last_token = cache, None, last


def measure(model, seat: bool, rows: int, tokens: int, chunk: int, settings, staged: bool) -> tuple[float, ...]:
    """(prefill s, join step s, join peak rise, steady step s, steady peak rise)."""
    from mlxformer.cache import make_cache
    from mlxformer.engine.batch_runner import BatchRunner

    runner = BatchRunner(model)
    runner.max_rows, runner.prefill_chunk, runner.staged = rows, chunk, staged
    sequences = [Row(make_cache(model, settings), 7) for _ in range(rows)]
    started = time.perf_counter()
    for i, sequence in enumerate(sequences):
        if seat:
            runner.seat(sequence)
        prompt = [(13 * j + i) % 4000 + 1 for j in range(tokens + i)]
        for start in range(0, len(prompt), chunk):
            if seat and staged:
                sequence.cache[0].pool.reserve(sequence.cache[0].offset + len(prompt[start : start + chunk]))
            runner.prefill(prompt[start : start + chunk], sequence.cache, want_logits=False)
    figures = [time.perf_counter() - started]
    for _ in range(2):
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        started = time.perf_counter()
        mx.eval(runner.decode(sequences), [layer.state for b in runner.pools.values() for layer in b.layers])
        figures += [time.perf_counter() - started, mx.get_peak_memory() - before]
    runner.reset()
    return tuple(figures)  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hybrid", action="store_true", help="a Qwen3.5: Gated DeltaNet and attention layers alternating")
    parser.add_argument("--mla", action="store_true", help="a DeepSeek-V3: multi-head latent attention")
    parser.add_argument("--staged", action="store_true", help="as under a KV budget")
    parser.add_argument("--max-kv-size", type=int, default=None, help="rotating caches of this window")
    args = parser.parse_args()
    from mlxformer.cache import CacheSettings

    settings = CacheSettings(max_kv_size=args.max_kv_size)
    with tempfile.TemporaryDirectory() as directory:
        model = random_model(directory, args.layers, args.hybrid, args.mla)
    print(f"load average {os.getloadavg()[0]:.1f}; {args.rows} rows x ~{args.tokens} tokens, {args.layers} layers"
          + (" (hybrid)" if args.hybrid else "") + (" (MLA)" if args.mla else "") + (", staged" if args.staged else "")
          + (f", max_kv_size {args.max_kv_size}" if args.max_kv_size else ""))
    for seat in (False, True):
        runs = [measure(model, seat, args.rows, args.tokens, args.chunk, settings, args.staged) for _ in range(args.repeats)]
        best = [min(x) for x in zip(*runs)]
        name = "seated at admission" if seat else "old join (copied)"
        print(f"{name:22s} prefill {best[0]:6.2f} s; join step {best[1] * 1e3:7.1f} ms, peak +{best[2] / 2**20:6.1f} MiB; "
              f"steady step {best[3] * 1e3:7.1f} ms, peak +{best[4] / 2**20:6.1f} MiB")


if __name__ == "__main__":
    main()
