"""Structured output: JSON Schema, regex and Lark/GBNF grammars the generated text must follow,
compiled with llguidance into per-sequence ``TokenConstraint`` masks."""

from mlxformer.constrained.grammars import (
    closed_schema, grammar_spec, is_gbnf, lark_from_gbnf, response_format_schema, validate_structured_output,
)
from mlxformer.constrained.matcher import GrammarConstraint, make_constraint
from mlxformer.constrained.vocab import grammar_tokenizer

__all__ = [
    "GrammarConstraint", "closed_schema", "make_constraint", "grammar_spec", "grammar_tokenizer", "is_gbnf", "lark_from_gbnf",
    "response_format_schema", "validate_structured_output",
]
