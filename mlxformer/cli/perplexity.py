"""``mlxformer perplexity``: sliding-window perplexity of a model on a text file."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from mlxformer.cli.common import add_model_args, add_verbose, load_for_cli


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``perplexity`` subcommand."""
    parser = subparsers.add_parser(
        "perplexity", help="sliding-window perplexity of a model on a text file",
        description="Sliding-window perplexity: windows of --context tokens advancing by --stride; "
                    "each token is scored once.",
    )
    add_model_args(parser)
    parser.add_argument("--text", required=True, help="UTF-8 text file to evaluate on")
    parser.add_argument("--context", type=int, default=256, help="window length in tokens (default 256)")
    parser.add_argument("--stride", type=int, default=128, help="window step in tokens (default 128)")
    add_verbose(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Handler of ``mlxformer perplexity``."""
    from mlxformer.errors import MlxformerError
    from mlxformer.tools.perplexity import perplexity

    path = Path(args.text)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise MlxformerError(f"{path}: cannot read text ({exc})") from None
    model, tokenizer = load_for_cli(args)
    ids = tokenizer.encode(text)
    start = time.perf_counter()
    ppl = perplexity(model, ids, args.context, args.stride)
    elapsed = time.perf_counter() - start
    print(f"tokens: {len(ids)}")
    print(f"perplexity: {ppl:.4f}")
    print(f"time: {elapsed:.2f} s ({len(ids) / elapsed:.1f} tokens/s)")
    return 0
