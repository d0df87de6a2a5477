"""Write the benchmark model files into .bench/models (not committed).

- smollm2-f32, smollm2-bf16: SmolLM2-135M-Instruct in HF layout, dequantized from the
  offline GGUF by transformers (the reference implementation) and saved as safetensors.
- smollm2-8bit, smollm2-4bit: mlx-lm's own conversions of smollm2-bf16 (its default settings).
- tiny-smollm2: a random 2-layer Llama (hidden 64) with SmolLM2's tokenizer and chat template:
  a forward of a few ms, so a server's own per-token cost shows (``serve_vs_mlx_lm.py``).
- llama-1b-bf16: a random checkpoint of the Llama-3.2-1B shape (1.24B parameters, bf16).
- qwen3moe-f32, qwen3moe-4bit: a random Qwen3-MoE-shaped checkpoint (Qwen3-30B-A3B's 128
  experts and top-8 routing, smaller widths: 4 layers, hidden 512, experts of 128), written by
  transformers, and mlx-lm's 4-bit conversion of it.

Usage: python benchmarks/prepare_models.py [--out .bench/models] [--skip-1b]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

LLAMA_1B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
    "num_hidden_layers": 16, "intermediate_size": 8192, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": True,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "hidden_act": "silu", "torch_dtype": "bfloat16",
}


def write_smollm(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mlxformer.default_model import default_model_path

    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model is marked quantized and refuses save_pretrained: copy it into a plain one.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(type(loaded.config).from_dict(config_dict), dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    for name, dtype in (("smollm2-f32", torch.float32), ("smollm2-bf16", torch.bfloat16)):
        target = out / name
        if not target.exists():
            model.to(dtype).save_pretrained(target)
            tokenizer.save_pretrained(target)


def write_mlx_lm_quantized(out: Path) -> None:
    from mlx_lm.convert import convert

    for bits in (8, 4):
        target = out / f"smollm2-{bits}bit"
        if not target.exists():
            convert(hf_path=str(out / "smollm2-bf16"), mlx_path=str(target), quantize=True, q_bits=bits)


def write_tiny(out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    target = out / "tiny-smollm2"
    if target.exists():
        return
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, max_position_embeddings=8192)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(target)
    AutoTokenizer.from_pretrained(out / "smollm2-f32").save_pretrained(target)


def write_llama_1b(out: Path) -> None:
    import mlx.core as mx

    target = out / "llama-1b-bf16"
    if target.exists():
        return
    target.mkdir(parents=True)
    c = LLAMA_1B
    hidden, inter, head_dim = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_dim, kv_dim = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> mx.array:
        return mx.array((rng.standard_normal(shape, dtype=np.float32) * 0.02)).astype(mx.bfloat16)

    weights = {"model.embed_tokens.weight": rand(c["vocab_size"], hidden), "model.norm.weight": mx.ones((hidden,), mx.bfloat16)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": rand(q_dim, hidden), p + "self_attn.k_proj.weight": rand(kv_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_dim, hidden), p + "self_attn.o_proj.weight": rand(hidden, q_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": mx.ones((hidden,), mx.bfloat16),
            p + "post_attention_layernorm.weight": mx.ones((hidden,), mx.bfloat16),
        })
    mx.save_safetensors(str(target / "model.safetensors"), weights, metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(c, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        source = out / "smollm2-bf16" / name
        if source.exists():
            shutil.copy(source, target / name)


def write_qwen3_moe(out: Path) -> None:
    import torch
    from mlx_lm.convert import convert
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    target = out / "qwen3moe-f32"
    if not target.exists():
        config = Qwen3MoeConfig(
            vocab_size=49152, hidden_size=512, intermediate_size=1024, moe_intermediate_size=128,
            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
            num_experts=128, num_local_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
            max_position_embeddings=4096, tie_word_embeddings=True,
        )
        torch.manual_seed(0)
        Qwen3MoeForCausalLM(config).to(torch.float32).save_pretrained(target)
        saved = json.loads((target / "config.json").read_text())
        # the keys real Qwen3-MoE configs carry and mlx-lm's model class requires
        saved.update(num_experts=128, rope_theta=(saved.get("rope_parameters") or {}).get("rope_theta", 1e6))
        (target / "config.json").write_text(json.dumps(saved, indent=2))
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (out / "smollm2-bf16" / name).exists():
                shutil.copy(out / "smollm2-bf16" / name, target / name)
    if not (out / "qwen3moe-4bit").exists():
        convert(hf_path=str(target), mlx_path=str(out / "qwen3moe-4bit"), quantize=True, q_bits=4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(".bench/models"))
    parser.add_argument("--skip-1b", action="store_true", help="do not write the 2.5 GB random 1B checkpoint")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    write_smollm(args.out)
    write_mlx_lm_quantized(args.out)
    write_tiny(args.out)
    if not args.skip_1b:
        write_llama_1b(args.out)
    write_qwen3_moe(args.out)
    print(f"models in {args.out}: {', '.join(sorted(p.name for p in args.out.iterdir()))}")


if __name__ == "__main__":
    main()
