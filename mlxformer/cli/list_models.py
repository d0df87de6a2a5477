"""``mlxformer list``: the models in the Hugging Face cache, with their format, quant, size and
whether mlxformer can load them (read from the cache alone: headers, no network), and the
installed default model (what commands use without ``--model``) with its path."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from mlxformer.cli.common import add_verbose

if TYPE_CHECKING:
    from mlxformer.formats.hub_cache import CachedModel


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``list`` subcommand."""
    parser = subparsers.add_parser("list", help="list the models in the Hugging Face cache and the default model")
    parser.add_argument("--json", action="store_true", help="print a JSON array, one object per model")
    add_verbose(parser)
    parser.set_defaults(handler=run)


def size_text(n: int) -> str:
    """Bytes as a short human size (``1.2 GB``)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def default_entry() -> CachedModel | None:
    """The installed default model as a row of the list (it lives in its PyPI package, not the cache)."""
    from mlxformer.default_model import installed_default_model
    from mlxformer.formats.hub_cache import CachedModel, load_problem
    from mlxformer.formats.hub_gguf import quant_of

    path = installed_default_model()
    if path is None:
        return None
    return CachedModel(path.stem, "", "gguf", quant_of(path.name) or "?", path.stat().st_size, path, (path,),
                       load_problem(path))


def as_json(model: CachedModel, default: bool) -> dict[str, Any]:
    """One model of ``list --json``."""
    return {"name": model.name, "format": model.format, "quant": model.quant, "size": model.size,
            "loadable": model.loadable, "problem": model.problem, "path": str(model.path), "default": default}


def run(args: argparse.Namespace) -> int:
    """Handler of ``mlxformer list``."""
    import json
    import sys

    from mlxformer.formats.hub_cache import cached_models

    default = default_entry()
    models = [(m, False) for m in cached_models()] + ([(default, True)] if default is not None else [])
    if args.json:
        print(json.dumps([as_json(m, is_default) for m, is_default in models], indent=2))
        return 0
    rows = [(m.name + (" (default)" if is_default else ""), m.format, m.quant, size_text(m.size),
             "yes" if m.loadable else f"no: {m.problem}") for m, is_default in models]
    header = ("NAME", "FORMAT", "QUANT", "SIZE", "LOADS")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths)) + "  " + row[4])
    if default is not None:
        print(f"default model (used without --model): {default.path}")
    else:
        from mlxformer.default_model import INSTALL_HINT

        print(f"the default model is not installed (get it with: {INSTALL_HINT})", file=sys.stderr)
    if len(models) == (default is not None):
        print("the Hugging Face cache holds no models; fetch one with 'mlxformer pull REPO[:QUANT]'", file=sys.stderr)
    return 0
