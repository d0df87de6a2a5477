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
    its adapters: ``BASE:NAME``), or none; another gets a 404. ``BASE:NAME`` naming no adapter of
    a server that has some is a 404 either way (a mistyped adapter never runs on the base)."""
    served = ctx.served
    unknown_adapter = (served.adapters is not None and requested is not None
                       and requested.startswith(f"{served.name}:") and served.base_name(requested) == requested)
    if unknown_adapter or (not ctx.any_model_name and requested and served.base_name(requested) != served.name):
        adapters = served.adapters.names if served.adapters is not None else ()
        raise not_found(requested, [served.name, *(f"{served.name}:{name}" for name in adapters)])
