"""``mlxformer cache-prompt``: prefill a prompt once and save its KV cache to a file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlxformer.cli.common import (
    add_cache_args, add_model_args, add_prompt_args, add_verbose, cache_settings, check_output_path, load_for_cli,
    prompt_ids_for_cli, read_prompt,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``cache-prompt`` subcommand."""
    parser = subparsers.add_parser("cache-prompt", help="prefill a prompt once and save its KV cache to a file")
    add_model_args(parser)
    add_prompt_args(parser)
    parser.add_argument("--prompt-cache-file", required=True, help="the file to write")
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")
    add_cache_args(parser)
    add_verbose(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Handler of ``mlxformer cache-prompt``."""
    from mlxformer.generation.prompt_cache_files import cache_prompt
    from mlxformer.errors import MlxformerError

    out = Path(args.prompt_cache_file)
    if out.exists() and not args.force:
        raise MlxformerError(f"{out} already exists (use --force to overwrite)")
    check_output_path(out)  # before loading the model
    prompt = read_prompt(args.prompt)
    settings = cache_settings(args)
    model, tokenizer = load_for_cli(args)
    # The user turn left open (no end-of-turn, no assistant header), so that `generate` with this
    # prompt, or a longer one that starts with it, finds these ids as its prefix.
    ids = prompt_ids_for_cli(tokenizer, prompt, args, continue_final_message=True)
    cache_prompt(out, model, tokenizer, ids, settings, overwrite=args.force)
    print(f"cached {len(ids)} tokens to {out} ({out.stat().st_size / 1e6:.2f} MB)", file=sys.stderr)
    return 0
