"""The OpenAI-compatible HTTP API over an ``Engine``: a thin FastAPI app.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /health`` and the chat
page at ``GET /``; mounted from their own modules: ``/v1/models`` (``meta_api``, also
``/tokenize``, ``/detokenize``, ``/apply-template``), ``/v1/messages`` (``anthropic_api``) and
``/v1/responses`` (``responses_api``). Every error is an OpenAI-style JSON body;
bad input is a 4xx, a full queue a 429. A client that goes away cancels its request.
"""

from __future__ import annotations

import asyncio
import hmac
from contextlib import aclosing
import logging
from importlib import resources
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from mlxformer.engine import Engine, EngineOverloaded, GenerationRequest, RequestHandle, TokenEvent
from mlxformer.errors import MlxformerError
from mlxformer.server.anthropic_api import is_anthropic_path, messages_router
from mlxformer.server.anthropic_protocol import anthropic_error
from mlxformer.server.chat_turn import chat_turn
from mlxformer.server.errors import APIError, error_body, validation_message
from mlxformer.server.hosting import Hosting
from mlxformer.server.meta_api import models_router, template_router
from mlxformer.server.protocol import ChatCompletionChunk, ChatCompletionRequest, CompletionRequest, CompletionResponse, new_id
from mlxformer.server.reply import whole_reply
from mlxformer.server.responses import (
    ChunkMaker, Collected, TokenStrings, chat_chunk_maker, chat_response, collect, completion_chunk_maker,
    completion_response, error_event, sse, usage_of,
)
from mlxformer.server.responses_api import responses_router
from mlxformer.server.translate import ServedModel, check_model_name, completion_prompt_ids, engine_request
from mlxformer.server.turn import Traits, prepare

log = logging.getLogger("mlxformer.server")

DISCONNECT_POLL_SECONDS = 0.25  # how often a non-streamed request checks that its client is still there
PAGE_SECURITY_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


class InFlight:
    """Counts the requests the engine is working on for this app (reported by /health)."""

    def __init__(self) -> None:
        self.count = 0


class Lease:
    """A submitted request held by one HTTP response: ``release`` (idempotent) cancels it unless
    it finished, and stops counting it."""

    def __init__(self, handle: RequestHandle, inflight: InFlight) -> None:
        self.handle, self.inflight = handle, inflight
        self.finished = self.released = False
        inflight.count += 1

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.inflight.count -= 1
        if not self.finished:
            self.handle.cancel()


class EventStream(StreamingResponse):
    """An SSE response that releases its request however the response ends (also when the
    client is gone before the first chunk, when the chunk generator never runs)."""

    def __init__(self, chunks: AsyncIterator[str], lease: Lease) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(chunks, media_type="text/event-stream", headers=headers)
        self.lease = lease

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.lease.release()


def chat_page() -> str:
    """The chat page's HTML, shipped in the package."""
    return resources.files("mlxformer.server").joinpath("static", "chat.html").read_text(encoding="utf-8")


def create_app(
    engine: Engine,
    served: ServedModel,
    *,
    api_key: str | None = None,
    cors_origins: Sequence[str] = (),
    tool_parser: str | None = None,
    any_model_name: bool = True,
) -> FastAPI:
    """The API app over a started ``engine``; ``api_key`` requires ``Authorization: Bearer``
    on /v1 routes; ``cors_origins`` (default none) are the origins allowed cross-origin access;
    ``tool_parser`` names the tool-call format (default: the one the chat template teaches);
    ``any_model_name``: the Anthropic and Responses routes serve any model name they are given."""
    app = FastAPI(title="mlxformer", docs_url=None, redoc_url=None)
    if cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"],
        )
    install_error_handlers(app)
    inflight = InFlight()
    text = TokenStrings(served.tokenizer)
    traits = Traits.of(served, tool_parser)
    router = APIRouter(prefix="/v1", dependencies=[Depends(key_checker(api_key))])

    def submit(request: GenerationRequest) -> Lease:
        try:
            handle = engine.submit(request)
        except EngineOverloaded as exc:
            raise APIError(
                f"the server is busy ({exc}); retry later", 429, "rate_limit_error", None, "queue_full"
            ) from exc
        except MlxformerError as exc:
            raise APIError(str(exc), 400) from exc
        return Lease(handle, inflight)

    @app.get("/", include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(chat_page(), headers={"Content-Security-Policy": PAGE_SECURITY_POLICY})

    @app.get("/health")
    async def health() -> dict[str, object]:
        return {"status": "ok", "model": served.name, "running": inflight.count}

    @router.post("/chat/completions", dependencies=[Depends(require_json)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model_name(body.model, served)
        prepared = prepare(chat_turn(body), served, traits)
        lease = submit(prepared.request)
        request_id = new_id("chatcmpl")
        if body.stream:
            make = chat_chunk_maker(request_id, served.name, text, body.logprobs, prepared.parser())
            first = ChatCompletionChunk.model_validate({
                "id": request_id, "model": served.name,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
            })

            def usage_chunk(last: TokenEvent | None) -> BaseModel:
                return ChatCompletionChunk(id=request_id, model=served.name, choices=[], usage=usage_of(last))

            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return EventStream(stream(lease, make, first, usage_chunk if include_usage else None), lease)
        result = await collect_unless_gone(lease, request)
        reply = whole_reply(prepared.parser(), result.events)
        return JSONResponse(chat_response(request_id, served.name, reply, text, body.logprobs).model_dump())

    @router.post("/completions", dependencies=[Depends(require_json)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model_name(body.model, served)
        if body.suffix:
            raise APIError("suffix is not supported", 400, param="suffix")
        ids = completion_prompt_ids(body, served.tokenizer, served.vocab_size)
        lease = submit(engine_request(
            body, ids, served, max_tokens=body.max_tokens, logprobs=body.logprobs, prompt_param="prompt",
        ))
        request_id = new_id("cmpl")
        echo = echo_text(body, ids, served) if body.echo else ""
        logprobs = body.logprobs is not None
        if body.stream:
            make = completion_chunk_maker(request_id, served.name, text, logprobs, echo)

            def usage_chunk(last: TokenEvent | None) -> BaseModel:
                return CompletionResponse(id=request_id, model=served.name, choices=[], usage=usage_of(last))

            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return EventStream(stream(lease, make, None, usage_chunk if include_usage else None), lease)
        result = await collect_unless_gone(lease, request)
        return JSONResponse(completion_response(request_id, served.name, result, text, logprobs, echo).model_dump())

    hosting = Hosting(served, traits, submit, EventStream, collect_unless_gone, any_model_name)
    router.include_router(models_router(hosting))
    for agent_router in (messages_router(hosting), responses_router(hosting)):
        router.include_router(agent_router, dependencies=[Depends(require_json)])
    app.include_router(router)
    app.include_router(template_router(hosting), dependencies=[Depends(key_checker(api_key)), Depends(require_json)])
    return app


def echo_text(body: CompletionRequest, ids: list[int], served: ServedModel) -> str:
    """The prompt as text, for ``echo``."""
    if isinstance(body.prompt, str):
        return body.prompt
    if body.prompt and isinstance(body.prompt[0], str):
        return str(body.prompt[0])
    return served.tokenizer.decode(ids)


def key_checker(api_key: str | None) -> Callable[[Request], None]:
    """A dependency that requires ``Authorization: Bearer <api_key>`` or (Anthropic clients)
    ``x-api-key: <api_key>`` (nothing when no key is set)."""

    def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            given = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError("invalid or missing API key (Authorization: Bearer ... or x-api-key)", 401,
                           "authentication_error", None, "invalid_api_key")

    return check


def require_json(request: Request) -> None:
    """POST bodies must be declared JSON: a cross-origin page cannot send that without CORS."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError("the request body must be JSON (Content-Type: application/json)", 415,
                       "invalid_request_error", None, "unsupported_media_type")


def install_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI-style body (Anthropic-style on the Messages routes): 400 for
    invalid input, never a traceback."""

    def respond(request: Request, body: dict[str, Any], status: int, headers: Any = None) -> JSONResponse:
        if is_anthropic_path(request.url.path):
            body = anthropic_error(status, body["error"]["message"])
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(request, exc.body(), exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return respond(request, error_body(message, "invalid_request_error", param), 400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return respond(request, error_body(str(exc.detail), kind), exc.status_code, exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return respond(request, error_body(f"internal server error ({type(exc).__name__})", "server_error"), 500)


async def stream(
    lease: Lease,
    make: ChunkMaker,
    first: BaseModel | None,
    usage_chunk: Callable[[TokenEvent | None], BaseModel] | None,
) -> AsyncIterator[str]:
    """SSE chunks for a request's events, then the usage chunk (if asked) and ``[DONE]``.
    If the client goes away (the response task is cancelled) the request is cancelled."""
    last: TokenEvent | None = None
    try:
        if first is not None:
            yield sse(first)
        async with aclosing(lease.handle.aiter()) as events:
            async for event in events:
                last = event
                lease.finished = lease.finished or event.finish_reason is not None
                chunk = make(event)
                if chunk is not None:
                    yield sse(chunk)
        if usage_chunk is not None:
            yield sse(usage_chunk(last))
        yield "data: [DONE]\n\n"
    except Exception as exc:  # the stream has started: report in-band
        log.exception("generation failed")
        yield error_event(f"generation failed ({type(exc).__name__})")
        yield "data: [DONE]\n\n"
    finally:
        lease.release()


async def collect_unless_gone(lease: Lease, request: Request) -> Collected:
    """All of a request's events; cancels the request if the client disconnects meanwhile."""
    task = asyncio.ensure_future(collect(lease.handle.aiter()))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                lease.finished = True
                return task.result()
            if await request.is_disconnected():
                raise APIError("client disconnected", 499, "invalid_request_error", None, "client_closed_request")
    finally:
        lease.release()
        if not task.done():
            task.cancel()
