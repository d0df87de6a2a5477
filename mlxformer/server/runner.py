"""Running the API app with uvicorn: in the foreground (``serve``) or in a background thread
(``ServerThread``, for tests and apps that embed the server)."""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
import sys
import threading
import time
from typing import Any, Sequence

import uvicorn
from fastapi import FastAPI

from mlxformer.cache import CacheSettings
from mlxformer.engine import Engine
from mlxformer.engine.prompt_cache import PromptCacheSettings
from mlxformer.errors import MlxformerError
from mlxformer.models.decoder import Model
from mlxformer.server.app import create_app
from mlxformer.server.guards import DEFAULT_MAX_BODY_BYTES, loopback_hosts
from mlxformer.server.registry import SingleHost
from mlxformer.server.sse import SSE_PING_SECONDS
from mlxformer.server.translate import ServedModel
from mlxformer.speculative.speculator import SpeculativeSettings
from mlxformer.text.tokenizer import Tokenizer

log = logging.getLogger("mlxformer.server")
START_TIMEOUT_SECONDS = 30.0


def is_loopback(host: str) -> bool:
    """Whether ``host`` only listens on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def served_hosts(host: str, extra: Sequence[str]) -> frozenset[str] | None:
    """The ``Host`` names a server bound to ``host`` answers (``None``: any)."""
    if is_loopback(host):
        return loopback_hosts(host, extra)
    return frozenset(extra) if extra else None


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` for uvicorn to listen on; a one-line error naming the
    address when it cannot be had (another server holds the port, a name that does not resolve)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc) or type(exc).__name__
        hint = "; another server is using the port: pick another --port" if exc.errno == errno.EADDRINUSE else ""
        raise MlxformerError(f"cannot listen on {host}:{port}: {reason}{hint}") from None
    return sock


class BoundServer(uvicorn.Server):
    """uvicorn's server on a socket ``bind`` made, announcing its URL as uvicorn does for a socket
    it binds itself (the line clients and scripts wait for)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and sockets:
            host, port = self.config.host, sockets[0].getsockname()[1]
            url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
            logging.getLogger("uvicorn.error").info("Uvicorn running on %s (Press CTRL+C to quit)", url)


def run_app(app: Any, host: str, port: int, sock: socket.socket | None = None) -> None:
    """Serve ``app`` with uvicorn in the foreground until interrupted, on ``sock`` (else
    ``host:port``, bound here)."""
    sock = sock if sock is not None else bind(host, port)
    config = uvicorn.Config(app, host=host, port=sock.getsockname()[1], log_level="info", timeout_graceful_shutdown=5)
    server = BoundServer(config)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down on (as uvicorn.run, a clean stop)
        pass
    finally:
        sock.close()
    if not server.started:
        raise MlxformerError("the server did not start (see the log above)")


def serve(
    model: Model,
    tokenizer: Tokenizer,
    name: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    max_batch: int = 8,
    max_queue: int = 64,
    api_key: str | None = None,
    cors_origins: Sequence[str] = (),
    cache_settings: CacheSettings | None = None,
    speculative: SpeculativeSettings | None = None,
    prompt_cache: PromptCacheSettings | None = None,
    allowed_hosts: Sequence[str] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    openapi: bool = True,
    tool_parser: str | None = None,
    any_model_name: bool = True,
    sse_ping_seconds: float | None = SSE_PING_SECONDS,
    strict_max_tokens: bool = False,
    force_tools: Sequence[str] = (),
    max_kv_memory: int | str | None = None,
    source: str | None = None,
    sock: socket.socket | None = None,
) -> None:
    """Serve ``model`` as ``name`` until interrupted (Ctrl-C stops the server and the engine);
    ``speculative`` decodes every request speculatively (prompt lookup or a draft model);
    ``prompt_cache`` sets the prompt cache's memory and disk tiers. ``allowed_hosts`` adds
    ``Host`` names to those served (on a loopback address: that address and ``localhost``;
    elsewhere: any, unless names are given). Streams send a keep-alive comment after
    ``sse_ping_seconds`` without data. ``max_kv_memory``: the engine's KV memory budget (bytes or
    ``"auto"``). ``tool_parser``, ``any_model_name``, ``strict_max_tokens``, ``force_tools``: see
    ``create_app``. ``source``: where the model was loaded from (shown by Ollama's ``/api/tags``).
    ``sock``: a socket ``bind`` made for ``host:port`` (else bound here)."""
    if not is_loopback(host) and api_key is None:
        log.warning("serving on %s without --api-key: anyone who can reach this host can use the model", host)
    engine = Engine(model, tokenizer, max_batch=max_batch, max_queue=max_queue, cache_settings=cache_settings,
                    speculative=speculative, prompt_cache=prompt_cache, max_kv_memory=max_kv_memory)
    if engine.budget is not None:  # what the process may grow by over its weights (engine/working_set.py)
        print(f"mlxformer: {engine.budget.describe()}", file=sys.stderr, flush=True)
    served = ServedModel.of(name, model, tokenizer)
    app = create_app(engine, served, api_key=api_key, cors_origins=cors_origins,
                     allowed_hosts=served_hosts(host, allowed_hosts), max_body_bytes=max_body_bytes, openapi=openapi,
                     tool_parser=tool_parser, any_model_name=any_model_name,
                     sse_ping_seconds=sse_ping_seconds, strict_max_tokens=strict_max_tokens,
                     force_tools=force_tools, host=lambda ctx: SingleHost(ctx, source))
    engine.start()
    try:
        run_app(app, host, port, sock)
    finally:
        engine.stop()


class ServerThread:
    """uvicorn serving ``app`` on ``host`` in a daemon thread; ``port=0`` picks a free port."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        """The base URL, e.g. ``http://127.0.0.1:41234``."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerThread:
        """Start serving; returns once the server accepts connections."""
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise MlxformerError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Stop serving and wait for the thread."""
        self.server.should_exit = True
        self.thread.join(timeout=START_TIMEOUT_SECONDS)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
