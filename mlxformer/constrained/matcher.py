"""``GrammarConstraint``: the ``TokenConstraint`` of one sequence, backed by an llguidance matcher."""

from __future__ import annotations

from typing import Any

import llguidance
import mlx.core as mx
import numpy as np

from mlxformer.constrained.grammars import check_grammar, grammar_spec
from mlxformer.constrained.vocab import grammar_tokenizer
from mlxformer.errors import MlxformerError
from mlxformer.text.tokenizer import Tokenizer

PARSER_LIMITS: llguidance.LLParserLimits | None = None  # None: llguidance's defaults
MAX_ERROR_CHARS = 300  # a matcher error may carry its statistics or the whole grammar


class GrammarConstraint:
    """Which tokens may come next under a grammar; ``done`` once the output is complete.

    ``next_mask`` runs llguidance on the CPU (it releases the GIL): the generation loop calls it
    while the device computes the step's logits.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._pending: mx.array | None = None  # the mask computed before the first token (make_constraint)

    def next_mask(self) -> mx.array:
        """Bool ``(vocab_size,)``: the tokens allowed next (EOS only where the grammar may end)."""
        if self._pending is not None:
            mask, self._pending = self._pending, None
            return mask
        words = self._matcher.compute_bitmask()  # one bit per token id, little-endian in 32-bit words
        self._raise_on_error()
        allowed = np.unpackbits(np.frombuffer(words, dtype=np.uint8), bitorder="little")[: self.vocab_size]
        if not allowed.any():
            raise MlxformerError("the grammar allows no token here")
        return mx.array(allowed.view(np.bool_))

    def advance(self, token: int) -> None:
        """Feed the generated token to the matcher."""
        self._pending = None
        if not self._matcher.consume_token(int(token)):
            self._raise_on_error()
            raise MlxformerError(f"token {token} is not allowed by the grammar")

    @property
    def done(self) -> bool:
        """The output is complete: the grammar ended, or EOS was accepted."""
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """What was generated so far is a complete match (it could end here)."""
        return self._matcher.is_accepting()

    def _raise_on_error(self) -> None:
        if self._matcher.is_error():
            raise MlxformerError(f"grammar matcher error: {one_line(self._matcher.get_error())}")


def one_line(message: str) -> str:
    """llguidance's error as one short line."""
    text = " ".join(message.split())
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


def make_constraint(
    tokenizer: Tokenizer,
    vocab_size: int,
    *,
    response_format: dict[str, Any] | None = None,
    regex: str | None = None,
    grammar: str | None = None,
) -> GrammarConstraint | None:
    """Compile the one constraint given (a JSON Schema / ``{"type": "json_object"}``
    ``response_format``, a ``regex``, or a Lark/GBNF ``grammar``) for a model with
    ``vocab_size`` logits; ``None`` when nothing is constrained.

    Raises ``MlxformerError`` (one short line) for a schema or grammar that does not compile, or
    that overflows the matcher's limits at its first token (that mask is computed here, once, and
    is the constraint's first ``next_mask``): whoever compiles it learns it at once.
    """
    spec = grammar_spec(response_format, regex, grammar)
    if spec is None:
        return None
    compiled, source = spec
    lltokenizer = grammar_tokenizer(tokenizer, vocab_size)
    check_grammar(compiled, source, lltokenizer)
    matcher = llguidance.LLMatcher(lltokenizer, compiled, log_level=0, limits=PARSER_LIMITS)
    if matcher.is_error():
        raise MlxformerError(f"cannot compile the {source}: {one_line(matcher.get_error())}")
    constraint = GrammarConstraint(matcher, vocab_size)
    try:
        constraint._pending = constraint.next_mask()
    except MlxformerError as exc:
        raise MlxformerError(f"the {source} cannot be applied (at its first token): {exc}") from None
    return constraint
