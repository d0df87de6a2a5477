"""The OpenAI-compatible HTTP API over an ``Engine``: a thin FastAPI app.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``
(``openai_routes``), ``POST /v1/messages`` (``anthropic_api``), ``POST /v1/responses``
(``responses_api``), ``POST /v1/embeddings`` and ``/v1/rerank`` (``embeddings_api``), ``GET /v1/models/{id}`` and ``POST /tokenize``, ``/detokenize``,
``/apply-template`` (``meta_api``), ``GET /health``, ``GET /openapi.json``, the chat page at
``GET /`` and Ollama's API under ``/api`` (``ollama_api``).
Every API router is made from the shared ``ServerContext`` and mounted by ``mount_api``: under
``/v1``, behind the API key, JSON bodies only. Every route, mounted or not, is behind the
``RequestGuard`` (Host allow-list, body limit). Every error is an OpenAI-style JSON body; bad
input is a 4xx, a full queue a 429. A client that goes away cancels its request.
"""

from __future__ import annotations

import logging
from importlib import resources
from typing import Any, Callable, Iterable, Sequence

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException

from mlxformer.engine import Engine
from mlxformer.server.anthropic_api import is_anthropic_path, messages_router
from mlxformer.server.anthropic_protocol import anthropic_error
from mlxformer.server.context import ServerContext
from mlxformer.server.embeddings_api import embeddings_router
from mlxformer.server.errors import APIError, error_body, validation_message
from mlxformer.server.guards import (
    DEFAULT_MAX_BODY_BYTES, LOOPBACK_NAMES, BodyTooLarge, RequestGuard, host_name, require_key,
)
from mlxformer.server.meta_api import models_router, template_router
from mlxformer.server.ollama_api import is_ollama_path, ollama_router
from mlxformer.server.openai_routes import openai_router
from mlxformer.server.metrics import install_metrics
from mlxformer.server.openapi import GUARDED, KEYED, error_responses, install_openapi
from mlxformer.server.registry import ModelHost, SingleHost
from mlxformer.server.chat_output import TokenStrings
from mlxformer.server.responses_api import responses_router
from mlxformer.server.sse import SSE_PING_SECONDS
from mlxformer.server.streaming import MAX_TOKENS_HEADER
from mlxformer.server.translate import ServedModel
from mlxformer.server.turn import Traits

log = logging.getLogger("mlxformer.server")

PAGE_SECURITY_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
# What the official OpenAI and Anthropic SDKs send from a browser (x-stainless-*: the SDKs' telemetry headers).
CORS_HEADERS = (
    "authorization", "content-type", "openai-organization", "openai-project", "openai-beta", "idempotency-key",
    "x-api-key", "anthropic-version", "anthropic-beta", "anthropic-dangerous-direct-browser-access",
    "x-stainless-arch", "x-stainless-lang", "x-stainless-os", "x-stainless-package-version",
    "x-stainless-retry-count", "x-stainless-runtime", "x-stainless-runtime-version", "x-stainless-timeout",
    "x-stainless-read-timeout", "x-stainless-async", "x-stainless-helper-method", "x-stainless-poll-helper",
    "x-stainless-custom-poll-interval",
)
RouterMaker = Callable[[ServerContext], APIRouter]
# each mounted under /v1 behind the key
API_ROUTERS: tuple[RouterMaker, ...] = (openai_router, models_router, messages_router, responses_router,
                                         embeddings_router)


def chat_page(name: str = "chat.html") -> str:
    """The chat page's HTML (or another of its files), shipped in the package."""
    return resources.files("mlxformer.server").joinpath("static", name).read_text(encoding="utf-8")


def create_app(
    engine: Engine,
    served: ServedModel,
    *,
    api_key: str | None = None,
    cors_origins: Sequence[str] = (),
    allowed_hosts: Iterable[str] | None = LOOPBACK_NAMES,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    openapi: bool = True,
    routers: Sequence[RouterMaker] = API_ROUTERS,
    tool_parser: str | None = None,
    any_model_name: bool = True,
    sse_ping_seconds: float | None = SSE_PING_SECONDS,
    host: Callable[[ServerContext], ModelHost] | None = None,
    strict_max_tokens: bool = False,
    force_tools: Sequence[str] = (),
) -> FastAPI:
    """The API app over a started ``engine``.

    ``api_key`` requires ``Authorization: Bearer`` (or ``x-api-key``) on every API route: /v1,
    /api (Ollama's), /tokenize and the template routes, /metrics, /openapi.json (not /health, /);
    ``cors_origins`` (default none) are the origins allowed cross-origin access; ``allowed_hosts``
    are the ``Host`` names served (default: the loopback names; ``None``: any); bodies over
    ``max_body_bytes`` get 413; ``openapi=False`` serves no /openapi.json; ``routers`` make the
    API routers (each mounted under /v1); ``tool_parser`` names the tool-call format (default: the
    one the chat template teaches); ``any_model_name``: every route serves any model name it is
    sent (False: only ``served.name``, ``registry.check_model``); streams send a keep-alive comment after ``sse_ping_seconds``
    without data (None: never); ``host`` makes the ``ModelHost`` of Ollama's ``/api`` routes from the
    context (default: this one model, any name); ``strict_max_tokens``: the Messages API refuses a
    ``max_tokens`` beyond the context's room instead of clamping it; ``force_tools``: a reply to a
    user turn that offers one of these tools (and leaves the choice to the model) calls it (``Traits``)."""
    app = FastAPI(title="mlxformer", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    ctx = ServerContext(engine, served, TokenStrings(served.tokenizer, served.vocab_size),
                        sse_ping_seconds=sse_ping_seconds, traits=Traits.of(served, tool_parser, tuple(force_tools)),
                        any_model_name=any_model_name, strict_max_tokens=strict_max_tokens)
    app.state.context = ctx
    keyed = [key_dependency(api_key), Depends(require_json)]
    for make in routers:
        mount_api(app, make(ctx), keyed)
    app.include_router(template_router(ctx), dependencies=keyed, responses=error_responses((*GUARDED, *KEYED, 415)))
    models = host(ctx) if host is not None else SingleHost(ctx)
    app.include_router(ollama_router(models), prefix="/api", dependencies=keyed, include_in_schema=False)

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)  # HEAD: clients' reachability check
    async def index() -> HTMLResponse:
        return HTMLResponse(chat_page(), headers={"Content-Security-Policy": PAGE_SECURITY_POLICY})

    @app.get("/favicon.ico", include_in_schema=False)  # the page's icon (browsers ask for this path)
    async def favicon() -> Response:
        return Response(chat_page("favicon.svg"), media_type="image/svg+xml")

    @app.get("/health", responses=error_responses((*GUARDED, 503)))
    async def health() -> JSONResponse:
        if not engine.running:
            return JSONResponse(error_body("the engine is not running", "server_error", None, "engine_not_running"), 503)
        return JSONResponse({"status": "ok", "model": served.name, "running": ctx.inflight.count})

    install_openapi(app)
    install_metrics(app, engine, keyed[:1])
    if openapi:
        @app.get("/openapi.json", include_in_schema=False, dependencies=keyed[:1])
        async def openapi_document() -> JSONResponse:
            return JSONResponse(app.openapi())

    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=list(CORS_HEADERS), expose_headers=[MAX_TOKENS_HEADER])
    hosts = None if allowed_hosts is None else frozenset(host_name(h) for h in allowed_hosts)
    app.add_middleware(RequestGuard, allowed_hosts=hosts, max_body_bytes=max_body_bytes, shape=api_shape,
                       json_bodies=is_ollama_path)
    return app


def mount_api(app: FastAPI, router: APIRouter, dependencies: list[Any]) -> None:
    """Mount an API router under /v1 behind ``dependencies`` (the API key, JSON bodies), its
    operations documenting the guard's and the key's errors."""
    app.include_router(router, prefix="/v1", dependencies=dependencies,
                       responses=error_responses((*GUARDED, *KEYED, 415)))


def key_dependency(api_key: str | None) -> Any:
    """A dependency that requires ``Authorization: Bearer <api_key>`` or (Anthropic's clients)
    ``x-api-key: <api_key>`` (nothing when no key is set; with a key, the OpenAPI document
    declares the bearer scheme). The dependencies are ``async``: a sync one would run on a worker
    thread that keeps its last request (and so the app) referenced."""
    if api_key is None:
        async def open_access() -> None:
            return None

        return Depends(open_access)

    async def check(request: Request,
              _: HTTPAuthorizationCredentials | None = Depends(HTTPBearer(auto_error=False))) -> None:
        require_key(request.headers, api_key)

    return Depends(check)


async def require_json(request: Request) -> None:
    """POST bodies must be declared JSON: a cross-origin page cannot send that without CORS."""
    if request.method != "POST":
        return
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError("the request body must be JSON (Content-Type: application/json)", 415,
                       "invalid_request_error", None, "unsupported_media_type")


def api_shape(path: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI error body as the API of ``path`` spells it (Anthropic's on the Messages routes,
    Ollama's ``{"error": ...}`` under /api)."""
    if is_ollama_path(path):
        return {"error": body["error"]["message"]}
    return anthropic_error(status, body["error"]["message"]) if is_anthropic_path(path) else body


def install_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI-style body (Anthropic-style on the Messages routes): 400 for
    invalid input, never a traceback."""

    def respond(request: Request, body: dict[str, Any], status: int, headers: Any = None) -> JSONResponse:
        return JSONResponse(api_shape(request.url.path, status, body), status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(request, exc.body(), exc.status, exc.headers)

    @app.exception_handler(BodyTooLarge)
    async def too_large(request: Request, exc: BodyTooLarge) -> JSONResponse:
        return respond(request, error_body(str(exc), "invalid_request_error", None, "request_too_large"), 413)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return respond(request, error_body(message, "invalid_request_error", param), 400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, BodyTooLarge):  # FastAPI wraps errors while reading the body
            too_big = error_body(str(exc.__cause__), "invalid_request_error", None, "request_too_large")
            return respond(request, too_big, 413)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return respond(request, error_body(str(exc.detail), kind), exc.status_code, exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return respond(request, error_body(f"internal server error ({type(exc).__name__})", "server_error"), 500)
