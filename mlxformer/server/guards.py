"""Checks every request passes before any route runs (pure ASGI, so they cover every router,
including those mounted later): a ``Host`` allow-list against DNS rebinding (403) and a body
size limit (413, decided from ``Content-Length`` before the body is parsed; the body is read and
discarded, up to a bound, before the answer, so that the client sees it); and, on the paths of an
API that reads every body as JSON (Ollama's: its curl examples send ``-d`` without a JSON
``Content-Type``), a body declared otherwise is read as JSON, unless a browser page sent it
(an ``Origin`` header), which must still declare JSON."""

from __future__ import annotations

import hmac
import json
from typing import Any, Awaitable, Callable, Iterable

from mlxformer.server.errors import APIError, error_body

Shape = Callable[[str, int, dict[str, Any]], dict[str, Any]]  # (path, status, OpenAI body) -> the body to send
ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
# A refused body is read and thrown away up to this many bytes before the 413 goes out, so that a
# client still writing it sees the status rather than a connection reset; past it we just close.
DRAIN_BYTES = 64 * 2**20
OPEN_PATHS = frozenset({"/", "/favicon.ico", "/health"})  # the chat page and the health check need no API key


class BodyTooLarge(Exception):
    """A streamed (chunked) body went past the limit while the app was reading it."""


def host_name(header: str) -> str:
    """The name in a ``Host`` header, without its port and brackets, lower-cased."""
    header = header.strip().lower()
    if header.startswith("["):  # "[::1]:8080"
        return header[1:].split("]", 1)[0]
    if header.count(":") == 1:
        return header.rsplit(":", 1)[0]
    return header


def scope_headers(scope: dict[str, Any]) -> dict[str, str]:
    """An ASGI request's headers, names lower-cased."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def require_key(headers: Any, api_key: str) -> None:
    """A 401 unless ``headers`` carry ``api_key``: ``Authorization: Bearer <key>`` or
    (Anthropic's clients) ``x-api-key: <key>``, compared in constant time."""
    scheme, _, token = headers.get("authorization", "").strip().partition(" ")
    given = token if scheme.lower() == "bearer" and token.strip() else headers.get("x-api-key", "")
    if not hmac.compare_digest(given.strip().encode(), api_key.encode()):
        raise APIError("invalid or missing API key (Authorization: Bearer ... or x-api-key)", 401,
                       "authentication_error", None, "invalid_api_key")


def loopback_hosts(bound: str, extra: Iterable[str] = ()) -> frozenset[str]:
    """The ``Host`` names a server bound to the loopback address ``bound`` answers: that address,
    ``localhost`` and the other loopback spellings, and ``extra``."""
    return frozenset(host_name(h) for h in (bound, *LOOPBACK_NAMES, *extra))


def openai_shape(path: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """Every error body as OpenAI's."""
    return body


async def send_error(send: Callable[[dict], Awaitable[None]], status: int, message: str, code: str,
                     path: str = "", shape: Shape = openai_shape) -> None:
    """Answer with an error body (OpenAI's, or what ``shape`` makes of it for ``path``) and close the connection."""
    kind = "permission_error" if status == 403 else "invalid_request_error"
    body = json.dumps(shape(path, status, error_body(message, kind, None, code))).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def drain(receive: Any, limit: int) -> None:
    """Read and discard the rest of a request body, at most ``limit`` bytes of it."""
    seen = 0
    while seen <= limit:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


class RequestGuard:
    """ASGI middleware: 403 for a ``Host`` not in ``allowed_hosts`` (``None``: any host), 413 for a
    body over ``max_body_bytes`` (declared by ``Content-Length``, or counted as it streams in);
    ``shape`` gives each error body the shape of the API its path belongs to."""

    def __init__(self, app: ASGIApp, allowed_hosts: frozenset[str] | None, max_body_bytes: int,
                 shape: Shape = openai_shape, json_bodies: Callable[[str], bool] = lambda path: False) -> None:
        self.app, self.allowed_hosts, self.max_body_bytes, self.shape = app, allowed_hosts, max_body_bytes, shape
        self.json_bodies = json_bodies

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope_headers(scope)
        if self.allowed_hosts is not None and host_name(headers.get("host", "")) not in self.allowed_hosts:
            await send_error(send, 403, "this server does not answer to that Host name (see --allowed-host)",
                             "host_not_allowed", scope.get("path", ""), self.shape)
            return
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await drain(receive, DRAIN_BYTES)
            await send_error(send, 413, self.too_large(), "request_too_large", scope.get("path", ""), self.shape)
            return
        if "origin" not in headers and self.json_bodies(scope.get("path", "")):
            scope = {**scope, "headers": [*(h for h in scope.get("headers", []) if h[0].lower() != b"content-type"),
                                          (b"content-type", b"application/json")]}
        await self.app(scope, self.counting(receive), send)

    def too_large(self) -> str:
        return f"the request body is larger than the limit of {self.max_body_bytes} bytes (--max-body-bytes)"

    def counting(self, receive: Any) -> Any:
        """``receive`` that raises ``BodyTooLarge`` once more than the limit has arrived."""
        seen = [0]

        async def wrapped() -> dict:
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.max_body_bytes:
                    if message.get("more_body", False):
                        await drain(receive, DRAIN_BYTES)
                    raise BodyTooLarge(self.too_large())
            return message

        return wrapped
