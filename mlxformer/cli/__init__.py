"""The command line: ``main`` parses flags into the library's dataclasses and calls the
library; the library never imports this package.

- ``main.py``: the ``mlxformer`` entry point, one subcommand per module, one-line errors.
- ``common.py``: flags shared by several commands and their translation (only ``argparse`` at
  module level, so ``--help`` stays light); ``structured.py``: the structured-output flags.
- One module per command: ``generate.py``, ``chat.py``, ``serve.py``, ``convert.py``,
  ``info.py``, ``perplexity.py``, ``bench.py``, ``cache_prompt.py`` (``cache-prompt``),
  ``embed.py``, ``pull.py``, ``list_models.py`` (``list``), ``rm.py``."""

from mlxformer.cli.main import main

__all__ = ["main"]
