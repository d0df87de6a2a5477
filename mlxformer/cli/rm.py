"""``mlxformer rm REPO[:QUANT]``: delete a model from the Hugging Face cache (asks first)."""

from __future__ import annotations

import argparse
import sys

from mlxformer.cli.common import add_verbose


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``rm`` subcommand."""
    parser = subparsers.add_parser("rm", help="delete a model from the Hugging Face cache")
    parser.add_argument("model", metavar="REPO[:QUANT]", help="the repo (all of it), or one GGUF of it by quant tag")
    parser.add_argument("--yes", "-y", action="store_true", help="do not ask")
    add_verbose(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Handler of ``mlxformer rm``."""
    from mlxformer.cli.list_models import size_text
    from mlxformer.errors import MlxformerError
    from mlxformer.formats.hub_cache import find_cached, remove

    models = find_cached(args.model)
    names = ", ".join(m.name for m in models)
    if not args.yes:
        sys.stderr.write(f"delete {names} ({size_text(sum(m.size for m in models))})? [y/N] ")
        sys.stderr.flush()
        if sys.stdin.readline().strip().lower() not in ("y", "yes"):
            raise MlxformerError("nothing deleted")
    freed = remove(models)
    print(f"deleted {names} ({size_text(freed)} freed)")
    return 0
