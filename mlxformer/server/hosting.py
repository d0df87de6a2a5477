"""The model-name rule every route applies (OpenAI's, Responses, Anthropic Messages, Ollama's),
and the 404 of a name no hosted model answers to."""

from __future__ import annotations

from mlxformer.server.context import ServerContext
from mlxformer.server.errors import APIError


def not_found(name: str, names: list[str]) -> APIError:
    """The 404 of a model name this server does not host."""
    return APIError(f"the model {name!r} does not exist; this server serves {', '.join(map(repr, names))}", 404,
                    "invalid_request_error", "model", "model_not_found")


def check_model(ctx: ServerContext, requested: str | None) -> None:
    """A model serves any name it is sent (apps and agents hard-code theirs), unless its server
    is strict about names (``--strict-model-names``): then only its own name (maybe with one of
    its adapters: ``BASE:NAME``), or none; another gets a 404."""
    if not ctx.any_model_name and requested and ctx.served.base_name(requested) != ctx.served.name:
        raise not_found(requested, [ctx.served.name])
