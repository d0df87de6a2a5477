"""``mlxformer list``: the models in the Hugging Face cache, with their format, quant, size and
whether mlxformer can load them (read from the cache alone: headers, no network)."""

from __future__ import annotations

import argparse

from mlxformer.cli.common import add_verbose


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``list`` subcommand."""
    parser = subparsers.add_parser("list", help="list the models in the Hugging Face cache")
    parser.add_argument("--json", action="store_true", help="one JSON object per model")
    add_verbose(parser)
    parser.set_defaults(handler=run)


def size_text(n: int) -> str:
    """Bytes as a short human size (``1.2 GB``)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def run(args: argparse.Namespace) -> int:
    """Handler of ``mlxformer list``."""
    import json

    from mlxformer.formats.hub_cache import cached_models

    models = cached_models()
    if args.json:
        for m in models:
            print(json.dumps({"name": m.name, "format": m.format, "quant": m.quant, "size": m.size,
                              "loadable": m.loadable, "problem": m.problem, "path": str(m.path)}))
        return 0
    rows = [(m.name, m.format, m.quant, size_text(m.size), "yes" if m.loadable else f"no: {m.problem}")
            for m in models]
    header = ("NAME", "FORMAT", "QUANT", "SIZE", "LOADS")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths)) + "  " + row[4])
    return 0
