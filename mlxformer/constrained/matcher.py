"""``GrammarConstraint``: the ``TokenConstraint`` of one sequence, backed by an llguidance matcher."""

from __future__ import annotations

from typing import Any

import llguidance
import mlx.core as mx
import numpy as np

from mlxformer.constrained.grammars import check_grammar, grammar_spec
from mlxformer.constrained.vocab import grammar_tokenizer
from mlxformer.errors import MlxformerError
from mlxformer.tokenizer import Tokenizer


class GrammarConstraint:
    """Which tokens may come next under a grammar; ``done`` once the output is complete.

    ``next_mask`` runs llguidance on the CPU (it releases the GIL): the generation loop calls it
    while the device computes the step's logits.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def next_mask(self) -> mx.array:
        """Bool ``(vocab_size,)``: the tokens allowed next (EOS only where the grammar may end)."""
        words = self._matcher.compute_bitmask()  # one bit per token id, little-endian in 32-bit words
        self._raise_on_error()
        allowed = np.unpackbits(np.frombuffer(words, dtype=np.uint8), bitorder="little")[: self.vocab_size]
        if not allowed.any():
            raise MlxformerError("the grammar allows no token here")
        return mx.array(allowed.view(np.bool_))

    def advance(self, token: int) -> None:
        """Feed the generated token to the matcher."""
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
            raise MlxformerError(f"grammar matcher error: {' '.join(self._matcher.get_error().split())}")


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

    Raises ``MlxformerError`` (one line) for a schema or grammar that does not compile.
    """
    spec = grammar_spec(response_format, regex, grammar)
    if spec is None:
        return None
    compiled, source = spec
    lltokenizer = grammar_tokenizer(tokenizer, vocab_size)
    check_grammar(compiled, source, lltokenizer)
    matcher = llguidance.LLMatcher(lltokenizer, compiled, log_level=0)
    if matcher.is_error():
        raise MlxformerError(f"cannot compile the {source}: {' '.join(matcher.get_error().split())}")
    return GrammarConstraint(matcher, vocab_size)
