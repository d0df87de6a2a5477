"""The command line: ``main`` parses flags into the library's dataclasses and calls the
library. One module per command; the library never imports this package."""

from mlxformer.cli.main import main

__all__ = ["main"]
