"""``GET /metrics``: the engine's Prometheus registry (``engine.metrics.registry``) in the text
exposition format, with the server's HTTP responses counted by route and status."""

from __future__ import annotations

from typing import Any, Sequence

from fastapi import FastAPI, Response
from fastapi.responses import PlainTextResponse
from fastapi.params import Depends
from starlette.routing import Mount, Route
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest

from mlxformer.engine import Engine
from mlxformer.server.openapi import GUARDED, KEYED, error_responses

EXPOSITION = {200: {"description": "the Prometheus text exposition format",
                    "content": {"text/plain": {"schema": {"type": "string"}}}}}


class CountResponses:
    """Pure ASGI middleware (streams pass through untouched): one count per response status."""

    def __init__(self, app: Any, counter: Counter) -> None:
        self.app, self.counter = app, counter

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                self.counter.labels(route_label(scope), str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, sending)


def route_label(scope: Any) -> str:
    """The matched route's template (``/v1/models/{model_id}``), never the raw path: each
    distinct path would be a new series. Unmatched paths share one label."""
    route = scope.get("route")
    if not isinstance(route, (Route, Mount)):
        return "unmatched"
    path = scope["path"]
    for start in (i for i, c in enumerate(path) if c == "/"):  # the route's own part, after its prefix
        if route.path_regex.fullmatch(path[start:]):
            return path[:start] + route.path
    return route.path


def install_metrics(app: FastAPI, engine: Engine, dependencies: Sequence[Depends] = ()) -> None:
    """Count every response into the engine's registry and serve the registry at ``/metrics``
    (behind ``dependencies``: the API key when there is one)."""
    registry = engine.metrics.registry
    counter = engine.metrics.counter("mlxformer_http_requests", "HTTP responses by route and status", ("route", "status"))
    app.add_middleware(CountResponses, counter=counter)

    @app.get("/metrics", dependencies=list(dependencies), response_class=PlainTextResponse,
             responses={**EXPOSITION, **error_responses((*GUARDED, *KEYED))})
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
