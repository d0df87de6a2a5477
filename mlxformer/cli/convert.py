"""``mlxformer convert``: an HF/MLX dir, hub repo or GGUF file -> an mlx-lm compatible MLX dir."""

from __future__ import annotations

import argparse

from mlxformer.cli.common import DTYPE_NAMES, add_verbose

DEFAULT_RECIPE = "mixed"  # the name of ``mlxformer.quant.quantize.DEFAULT_RECIPE``


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``convert`` subcommand."""
    parser = subparsers.add_parser(
        "convert", help="convert an HF/MLX/GGUF checkpoint to an MLX dir (optionally quantized)",
        description="Convert a Hugging Face repo or dir, an MLX dir or a GGUF file to an mlx-lm compatible MLX dir.",
    )
    parser.add_argument("--hf-path", help="HF repo id (REPO:QUANT picks a GGUF), local HF/MLX dir or .gguf file "
                                           "(default: the offline SmolLM2-135M-Instruct, see 'mlxformer list')")
    parser.add_argument("--mlx-path", default="mlx_model", help="output dir (default: mlx_model)")
    parser.add_argument("-q", "--quantize", action="store_true", help=f"quantize (default recipe: {DEFAULT_RECIPE})")
    parser.add_argument("--q-bits", type=int, default=None, help="bits per weight: 2, 3, 4, 5, 6 or 8 (default 4)")
    parser.add_argument("--q-group-size", type=int, default=None, help="group size: 32, 64 or 128 (default 64)")
    parser.add_argument("--quant-recipe", default=None, help=f"quantization recipe (default {DEFAULT_RECIPE})")
    parser.add_argument("--dtype", default=None, help=f"{', '.join(DTYPE_NAMES)} for float tensors and scales")
    parser.add_argument("--dequantize", action="store_true", help="write a quantized source as float")
    parser.add_argument("--force", action="store_true", help="replace an existing --mlx-path")
    parser.add_argument("--adapter", metavar="DIR",
                        help="fuse this LoRA/DoRA adapter (mlx-lm's or PEFT's) into the written weights")
    add_verbose(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Handler of ``mlxformer convert``."""
    from mlxformer.tools.converter import convert
    from mlxformer.default_model import model_source

    out = convert(
        model_source(args.hf_path), args.mlx_path, quantize=args.quantize, q_bits=args.q_bits,
        q_group_size=args.q_group_size, dtype=args.dtype, quant_recipe=args.quant_recipe, dequantize=args.dequantize,
        force=args.force, adapter=args.adapter,
    )
    print(f"wrote {out}")
    return 0
