"""The several-models server: ``several_models_app`` builds the front (Ollama's ``/api``,
``GET /v1/models`` with each model's state, ``GET /metrics`` per model, ``GET /health``) over a
``MultiHost`` whose models each get the same API app as a one-model server (``create_app``),
and ``serve_models`` runs it with uvicorn."""

from __future__ import annotations

import asyncio
import socket
from typing import Any, Callable, Iterable, Sequence

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from mlxformer.server.app import api_shape, install_error_handlers, key_dependency, require_json
from mlxformer.server.errors import APIError
from mlxformer.server.guards import DEFAULT_MAX_BODY_BYTES, LOOPBACK_NAMES, RequestGuard, host_name
from mlxformer.server.hosts import MultiHost, MultiModelApp
from mlxformer.server.ollama_api import is_ollama_path, ollama_router
from mlxformer.server.runner import run_app

FRONT_PATHS = ("/v1/models", "/metrics", "/health")


def is_front_path(path: str) -> bool:
    """Whether the front answers ``path`` itself (not one model's app)."""
    return is_ollama_path(path) or path in FRONT_PATHS


def several_models_app(
    host: MultiHost, *, api_key: str | None = None, allowed_hosts: Iterable[str] | None = LOOPBACK_NAMES,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> RequestGuard:
    """The ASGI app of a several-models server (the models' own apps take the same guard and key)."""
    front = FastAPI(title="mlxformer", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(front)
    key = key_dependency(api_key)
    front.include_router(ollama_router(host), prefix="/api", dependencies=[key, Depends(require_json)],
                         include_in_schema=False)

    @front.get("/v1/models", dependencies=[key])
    async def models() -> dict[str, Any]:
        records = await asyncio.get_running_loop().run_in_executor(None, host.records)  # may read checkpoints
        data = [{"id": r.name, "object": "model", "created": 0, "owned_by": "mlxformer",
                 "state": "loaded" if r.loaded else "on disk", "context_length": r.context_length,
                 "capabilities": r.capabilities, "source": r.path, **({"error": r.problem} if r.problem else {})}
                for r in records]
        return {"object": "list", "data": data}

    @front.get("/metrics", dependencies=[key], response_class=PlainTextResponse)
    async def metrics(model: str | None = None) -> Response:
        if model is None:
            lines = ["# HELP mlxformer_model_loaded Whether each hosted model is loaded",
                     "# TYPE mlxformer_model_loaded gauge"]
            lines += [f'mlxformer_model_loaded{{model="{r.name}"}} {int(r.loaded)}' for r in host.records()]
            lines += memory_metric_lines(host)
            return PlainTextResponse("\n".join(lines) + "\n")
        entry = host.entry(model)
        if entry.app is None:
            raise APIError(f"the model {model!r} is not loaded", 404, "invalid_request_error", "model")
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(entry.context.engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @front.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok", "models": {r.name: "loaded" if r.loaded else "on disk"
                                                        for r in host.records()}})

    hosts = None if allowed_hosts is None else frozenset(host_name(h) for h in allowed_hosts)
    return RequestGuard(MultiModelApp(front, host, is_front_path, api_shape, api_key), allowed_hosts=hosts,
                        max_body_bytes=max_body_bytes, shape=api_shape, json_bodies=is_ollama_path)


def memory_metric_lines(host: MultiHost) -> list[str]:
    """Prometheus lines of the memory the models hold: each one's weights (0 once unloaded) and
    MLX's allocated and cached bytes (all models)."""
    import mlx.core as mx

    lines = ["# HELP mlxformer_model_weight_bytes Bytes of each hosted model's weights in memory",
             "# TYPE mlxformer_model_weight_bytes gauge"]
    lines += [f'mlxformer_model_weight_bytes{{model="{name}"}} {size}' for name, size in host.weight_bytes().items()]
    for name, value, help_ in (("active", mx.get_active_memory(), "held by MLX arrays"),
                               ("cache", mx.get_cache_memory(), "in MLX's buffer cache")):
        lines += [f"# HELP mlxformer_mlx_{name}_bytes Bytes {help_}", f"# TYPE mlxformer_mlx_{name}_bytes gauge",
                  f"mlxformer_mlx_{name}_bytes {value}"]
    return lines


def serve_models(
    sources: dict[str, str], make_app: Callable[[str, str, MultiHost], tuple[FastAPI, Callable[[], None]]], *,
    host: str = "127.0.0.1", port: int = 8080, max_loaded: int = 1, max_memory: int | None = None,
    max_kv_memory: int | str | None = None, tool_parser: str | None = None, idle_unload: float | None = None,
    strict: bool = False, api_key: str | None = None, allowed_hosts: Sequence[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, sock: socket.socket | None = None,
) -> None:
    """Serve ``{name: source}`` until interrupted; ``make_app(name, source, host)`` loads one
    model and returns its API app and the function that stops its engine; ``sock``: as ``runner.serve``'s."""
    models: MultiHost | None = None

    def maker(name: str, source: str) -> tuple[FastAPI, Callable[[], None]]:
        assert models is not None
        return make_app(name, source, models)

    models = MultiHost(sources, maker, max_loaded=max_loaded, idle_unload=idle_unload, strict=strict,
                       max_memory=max_memory, max_kv_memory=max_kv_memory, tool_parser=tool_parser)
    app = several_models_app(models, api_key=api_key, allowed_hosts=allowed_hosts, max_body_bytes=max_body_bytes)
    try:
        run_app(app, host, port, sock)
    finally:
        models.close()
