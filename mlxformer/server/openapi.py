"""The OpenAPI document tells what the server does: each route's errors with the OpenAI error
schema, its 200 models (and the SSE stream of a streaming route), no FastAPI 422s (validation
errors are 400s here)."""

from __future__ import annotations

from typing import Any, Iterable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from mlxformer.server.protocol import ErrorResponse
from mlxformer.server.streaming import SSE_MEDIA_TYPE

ERROR_MEANINGS = {
    400: "invalid request (the error's param names the field)",
    401: "missing or wrong API key",
    403: "Host header not allowed",
    404: "unknown model or route",
    405: "method not allowed",
    413: "request body too large",
    415: "the body is not declared as JSON",
    429: "the server is busy (see Retry-After)",
    500: "internal error",
    503: "the engine is not running",
}
GUARDED = (403, 413)  # every route: the request guard answers these before routing
KEYED = (401,)  # routes behind the API key
GENERATION = (400, 404, 405, 415, 429, 500, 503)  # the generation routes
BODY = (400,)  # routes that read a JSON body (it may be malformed or invalid)


def error_responses(statuses: Iterable[int], model: type[BaseModel] = ErrorResponse) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for ``statuses``, each with the error body ``model`` (OpenAI's by default)."""
    return {s: {"model": model, "description": ERROR_MEANINGS[s]} for s in sorted(set(statuses))}


def streamed_ok(model: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The 200 of a route that answers ``model`` as JSON, or (``stream: true``) SSE events each
    carrying a ``chunk`` JSON object (``data: {...}``), ending with ``data: [DONE]``."""
    description = f"a {model.__name__}, or with stream: true server-sent events of {chunk.__name__} objects"
    event = {  # OpenAPI < 3.2: the schema of an event stream describes one event
        "type": "object", "required": ["data"],
        "properties": {
            "data": {"type": "string", "description": f"a {chunk.__name__} (or an error) as JSON; the last: [DONE]"},
            "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"},
        },
    }
    return {200: {"model": model, "description": description, "content": {SSE_MEDIA_TYPE: {"schema": event}}}}


def install_openapi(app: FastAPI) -> None:
    """Build the app's document without FastAPI's 422 responses and schemas."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
