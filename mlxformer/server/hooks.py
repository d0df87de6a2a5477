"""Hooks for the request fields that other features serve: ``response_format`` (structured
output through ``mlxformer.constrained``; ``tools`` are in ``mlxformer.server.tools``)."""

from __future__ import annotations

from mlxformer.constrained import make_constraint
from mlxformer.errors import MlxformerError
from mlxformer.sampling.samplers import TokenConstraint
from mlxformer.server.errors import bad_request
from mlxformer.server.protocol import ResponseFormat
from mlxformer.text.tokenizer import Tokenizer


def constraint_for(
    response_format: ResponseFormat | None, tokenizer: Tokenizer, vocab_size: int
) -> TokenConstraint | None:
    """The per-request token constraint for ``response_format``: ``None`` for free text, a
    grammar constraint for ``json_object`` / ``json_schema``; a schema that does not compile is a 400."""
    if response_format is None or response_format.type == "text":
        return None
    try:
        return make_constraint(tokenizer, vocab_size, response_format=response_format.model_dump(exclude_none=True))
    except MlxformerError as exc:
        raise bad_request(str(exc), param="response_format", code="invalid_response_format") from exc
