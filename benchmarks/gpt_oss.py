"""gpt-oss-shaped model, mlxformer beside mlx-lm on the same files (``vs_mlx_lm.py``'s trials).

Writes an MLX dir in the mlx-community gpt-oss layout with random weights: gpt-oss-20b's
layer shapes (hidden 2880, 64 query / 8 key-value heads of 64, 32 experts of 2880, top-4,
sliding window 128 on every other layer, attention sinks, YaRN), MXFP4 experts (MLX's
``mxfp4``), the rest bfloat16; only ``--layers`` layers and a ``--vocab`` vocabulary, so it
fits a small machine. Then runs ``vs_mlx_lm.py`` on it: prefill and decode, interleaved trials.

Usage:
  python benchmarks/gpt_oss.py [--layers 4] [--vocab 32000] [--trials 3] [--prompt-tokens 512]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import vs_mlx_lm  # noqa: E402  (benchmarks/ is not a package)

NAME = "gpt-oss-shaped-mxfp4"


def gpt_oss_config(layers: int, vocab: int) -> dict:
    """gpt-oss-20b's config.json with fewer layers and a smaller vocabulary."""
    return {
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": layers, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": vocab, "rms_norm_eps": 1e-5,
        "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4, "sliding_window": 128,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "attention_bias": True, "swiglu_limit": 7.0, "max_position_embeddings": 131072, "rope_theta": 150000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 4096, "truncate": False},
        "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": 0,
        "quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"},
    }


def write_model(directory: Path, layers: int, vocab: int) -> None:
    """Random weights in the mlx-community layout: experts as random mxfp4 codes and scales
    (never a float expert matrix in memory), the rest bfloat16."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlxformer.models.config import ModelArgs
    from mlxformer.models.decoder import Model
    from mlxformer.models.moe import QuantizedSwitchLinear

    config = gpt_oss_config(layers, vocab)
    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(config))
    for layer in model.layers:
        experts = layer.mlp.experts
        for name in ("gate_proj", "up_proj", "down_proj"):
            float_layer = experts[name]
            E, out, inp = float_layer.weight.shape
            packed = QuantizedSwitchLinear.__new__(QuantizedSwitchLinear)
            nn.Module.__init__(packed)
            packed.group_size, packed.bits, packed.mode = 32, 4, "mxfp4"
            packed.weight = mx.random.randint(0, 2**31, (E, out, inp // 8)).astype(mx.uint32)
            packed.scales = mx.random.randint(117, 121, (E, out, inp // 32)).astype(mx.uint8)  # 2**-10 .. 2**-7
            packed.bias = mx.zeros((E, out))
            experts[name] = packed
    model.set_dtype(mx.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_byte_tokenizer(directory)


def write_byte_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer (the benchmark feeds random ids; both runtimes need one to load)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=257, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["a"], trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models-dir", type=Path, default=Path(".bench/models"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--generation-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.layers < 2:
        parser.error("--layers must be at least 2 (mlx-lm's gpt_oss needs a sliding and a full layer)")
    directory = args.models_dir / NAME
    if not (directory / "config.json").exists():
        write_model(directory, args.layers, args.vocab)
    sys.argv = [vs_mlx_lm.__file__, "--models-dir", str(args.models_dir), "--models", NAME,
                "--trials", str(args.trials), "--prompt-tokens", str(args.prompt_tokens),
                "--generation-tokens", str(args.generation_tokens)]
    vs_mlx_lm.main()


if __name__ == "__main__":
    main()
