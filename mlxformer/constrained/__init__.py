"""Structured output: JSON Schema, regex and Lark/GBNF grammars the generated text must follow,
compiled with llguidance into per-sequence ``TokenConstraint`` masks.

- ``grammars.py``: ``response_format`` / ``regex`` / ``grammar`` into one llguidance grammar,
  checked against the tokenizer before any generation.
- ``vocab.py``: the tokenizer as llguidance sees it (every token id's bytes).
- ``matcher.py``: ``GrammarConstraint``, one sequence's constraint, and ``make_constraint``.
- ``tools.py``: OpenAI-style tool calling over structured output (``tools``/``tool_choice``
  checked, the schema of a forced call, tools described to templates that take none)."""

from mlxformer.constrained.grammars import (
    closed_schema, grammar_spec, is_gbnf, lark_from_gbnf, response_format_schema, validate_structured_output,
)
from mlxformer.constrained.matcher import GrammarConstraint, make_constraint
from mlxformer.constrained.vocab import grammar_tokenizer

__all__ = [
    "GrammarConstraint", "closed_schema", "make_constraint", "grammar_spec", "grammar_tokenizer", "is_gbnf", "lark_from_gbnf",
    "response_format_schema", "validate_structured_output",
]
