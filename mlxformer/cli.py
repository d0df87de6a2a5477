"""``mlxformer`` command line: subcommands, shared flags, and one-line errors."""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence


from .cache import CacheSettings
from .config import FLOAT_DTYPES
from .errors import MlxformerError
from .generate import SamplingSettings

if TYPE_CHECKING:
    from .model import Model
    from .tokenizer import Tokenizer



def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--dtype`` and ``--threads``."""
    parser.add_argument(
        "--model", "-m",
        help="HF repo id, local HF/MLX dir or .gguf file (default: the offline SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--dtype", choices=sorted(FLOAT_DTYPES),
        help="compute dtype for floating parameters (default: the checkpoint's; float32 for quantized models on CPU)",
    )
    parser.add_argument(
        "--threads", "-t", type=int, default=None,
        help="CPU streams to split each projection over (default: usable cores, at most 4, on CPU; 1 on GPU)",
    )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """The sampling flags shared by generate and chat."""
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0: off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="min probability relative to the top token (default 0: off)")
    parser.add_argument("--repetition-penalty", type=float, default=None, help="penalty on the last 64 tokens, e.g. 1.1")
    parser.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def add_cache_args(parser: argparse.ArgumentParser) -> None:
    """KV cache flags shared by generate, chat and bench."""
    parser.add_argument("--kv-bits", type=int, choices=(4, 8), default=None, help="quantize the KV cache to 4 or 8 bits")
    parser.add_argument("--kv-group-size", type=int, choices=(32, 64, 128), default=64, help="KV quantization group (default 64)")
    parser.add_argument("--quantized-kv-start", type=int, default=0, help="quantize the cache once it holds this many tokens")
    parser.add_argument("--max-kv-size", type=int, default=None, help="keep at most this many tokens (rotating cache)")


def sampling_settings(args: argparse.Namespace) -> SamplingSettings:
    """The sampling dataclass from parsed flags."""
    settings = SamplingSettings(
        temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed,
    )
    if settings.temp < 0 or not 0 < settings.top_p <= 1 or settings.top_k < 0 or not 0 <= settings.min_p < 1:
        raise MlxformerError("need --temp >= 0, 0 < --top-p <= 1, --top-k >= 0 and 0 <= --min-p < 1")
    if settings.repetition_penalty is not None and settings.repetition_penalty <= 0:
        raise MlxformerError("--repetition-penalty must be positive")
    return settings


def cache_settings(args: argparse.Namespace) -> CacheSettings:
    """The cache dataclass from parsed flags."""
    if args.max_kv_size is not None and args.max_kv_size < 1:
        raise MlxformerError("--max-kv-size must be positive")
    return CacheSettings(
        kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
        quantized_kv_start=args.quantized_kv_start, max_kv_size=args.max_kv_size,
    )


def load_for_cli(args: argparse.Namespace) -> tuple[Model, Tokenizer]:
    """``load`` on ``--model`` (or the default model) with ``--dtype`` and ``--threads``."""
    from .default_model import default_model_path
    from .loader import load

    source: str | Path = args.model if args.model else default_model_path()
    if args.threads is not None and args.threads < 1:
        raise MlxformerError("--threads must be at least 1")
    return load(source, dtype=FLOAT_DTYPES[args.dtype] if args.dtype else None, threads=args.threads)


def _command_modules() -> list[Callable[[argparse._SubParsersAction], None]]:
    from . import bench, chat, cli_generate, converter, perplexity, prompt_cache

    return [
        cli_generate.register, chat.register, converter.register,
        perplexity.register, bench.register, prompt_cache.register,
    ]


def build_parser() -> argparse.ArgumentParser:
    """The full ``mlxformer`` parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="mlxformer", description="Run LLaMA-family LLMs with MLX.")
    parser.add_argument("--verbose", "-v", action="store_true", help="show tracebacks and extra detail")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in _command_modules():
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mlxformer`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    verbose = bool(getattr(args, "verbose", False) or getattr(args, "verbose_sub", False))
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # every failure is one line unless --verbose
        if verbose:
            traceback.print_exc()
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        prefix = "" if isinstance(exc, MlxformerError) else f"{type(exc).__name__}: "
        print(f"mlxformer: error: {prefix}{message}", file=sys.stderr)
        return 1
