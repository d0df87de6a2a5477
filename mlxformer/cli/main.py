"""The ``mlxformer`` entry point: one subcommand per module in this package, one-line errors."""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import NoReturn, Sequence

from mlxformer.cli import bench, cache_prompt, chat, convert, embed, generate, info, list_models, perplexity, pull, rm, serve

COMMANDS = (generate, chat, convert, perplexity, bench, cache_prompt, info, serve, pull, list_models, rm, embed)


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose own errors (a bad choice or type, a missing flag) are one line
    naming the command's help, not the whole usage; subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    """The full ``mlxformer`` parser with every subcommand."""
    parser = OneLineParser(prog="mlxformer", description="Run LLaMA-family LLMs with MLX.")
    parser.add_argument("--verbose", "-v", action="store_true", help="show tracebacks and extra detail")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(subparsers)
    for command_parser in subparsers.choices.values():
        command_parser.set_defaults(command_parser=command_parser)  # its errors point at its own --help
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mlxformer`` console script; returns the exit code."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
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
        from mlxformer.errors import MlxformerError

        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        prefix = "" if isinstance(exc, MlxformerError) else f"{type(exc).__name__}: "
        print(f"mlxformer: error: {prefix}{message}", file=sys.stderr)
        return 1
