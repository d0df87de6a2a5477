"""``mlxformer pull REPO[:QUANT]``: fetch a model into the Hugging Face cache (the hub's own
download and progress bars), as ``--model REPO[:QUANT]`` would on first use."""

from __future__ import annotations

import argparse

from mlxformer.cli.common import add_verbose


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``pull`` subcommand."""
    parser = subparsers.add_parser(
        "pull", help="download a model from the Hugging Face hub into its cache",
        description="Download REPO (its safetensors model) or one GGUF of it: REPO:QUANT picks the GGUF by its quant "
                    "tag, case-insensitively (e.g. :Q4_K_M); without a tag a GGUF-only repo gives Q4_K_M, else the "
                    "largest that fits in memory. Split GGUFs are fetched whole.",
    )
    parser.add_argument("model", metavar="REPO[:QUANT]", help="a hub repo id, with an optional GGUF quant tag")
    add_verbose(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Handler of ``mlxformer pull``."""
    from mlxformer.errors import MlxformerError
    from mlxformer.formats.hub import fetch, is_repo_ref
    from mlxformer.formats.hub_cache import load_problem

    if not is_repo_ref(args.model):
        raise MlxformerError(f"{args.model!r} is not a hub repo id (OWNER/NAME[:QUANT])")
    path = fetch(args.model)
    if (problem := load_problem(path)) is not None:  # e.g. pickled weights only: fetched, never loadable
        raise MlxformerError(f"{args.model} does not load: {problem} ('mlxformer rm {args.model}' removes it)")
    print(path)
    return 0
