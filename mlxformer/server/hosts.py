"""Several models in one server: ``MultiHost`` loads each on first use (its own engine and API
app, made by ``create_app``), keeps at most ``max_loaded`` and, with ``max_memory``, at most that
many bytes of weights plus KV budgets (least recently used out; the sizes of a model not loaded
come from its checkpoint, ``server/model_facts.py``; a model that cannot fit even alone gets a
507 naming the sizes, and the others keep serving), unloads a
model idle for its keep-alive (``idle_unload`` seconds by default, or a request's ``keep_alive``
with Ollama's semantics: 0 unloads after the reply, negative keeps it), and reports each
model's state. ``MultiModelApp`` is the ASGI front: model-level routes (Ollama's ``/api``,
``/v1/models``, ``/metrics``) on its own app, every other request forwarded to the app of the
model its JSON body names (the first model's for requests that name none)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import FastAPI

from mlxformer.server.context import ServerContext
from mlxformer.server.errors import APIError
from mlxformer.server.guards import OPEN_PATHS, BodyTooLarge, require_key, scope_headers, send_error
from mlxformer.server.hosting import not_found
from mlxformer.server.model_facts import ModelFacts, kv_budget_of, mib, model_facts
from mlxformer.server.registry import ModelRecord, loaded_record

log = logging.getLogger("mlxformer.server")
REAP_SECONDS = 0.5  # how often idle models are looked for
# (name, source) -> (the model's API app, whose state.context is its ServerContext; a stop function)
AppMaker = Callable[[str, str], tuple[FastAPI, Callable[[], None]]]


@dataclass
class Hosted:
    """One model: where it loads from and, once loaded, its app."""

    name: str
    source: str
    app: FastAPI | None = None
    stop: Callable[[], None] | None = None
    last_used: float = 0.0
    expires_at: float | None = None  # when it unloads if idle (None: never)
    problem: str | None = None
    facts: ModelFacts | None = None  # read from its checkpoint when first needed
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def context(self) -> ServerContext:
        assert self.app is not None
        return self.app.state.context

    @property
    def busy(self) -> bool:
        """Whether its engine is working on a request of this server's."""
        return self.app is not None and self.context.inflight.count > 0


class MultiHost:
    """The ``ModelHost`` of several models (see the module docstring)."""

    def __init__(self, sources: dict[str, str], make_app: AppMaker, *, max_loaded: int = 1,
                 idle_unload: float | None = None, strict: bool = False, max_memory: int | None = None,
                 max_kv_memory: int | str | None = None, tool_parser: str | None = None) -> None:
        self.models = {name: Hosted(name, source) for name, source in sources.items()}
        self.make_app, self.max_loaded, self.idle_unload, self.strict = make_app, max(1, max_loaded), idle_unload, strict
        self.max_memory, self.max_kv_memory, self.tool_parser = max_memory, max_kv_memory, tool_parser
        self.guard = threading.Lock()  # loads and unloads, one at a time
        self.reaper: asyncio.Task[None] | None = None

    def entry(self, name: str | None) -> Hosted:
        """The model ``name`` picks: its own entry; with one model and no strict names, any name."""
        if name in self.models:
            return self.models[name]  # type: ignore[index]
        if not name or (len(self.models) == 1 and not self.strict):
            return next(iter(self.models.values()))
        raise not_found(name, list(self.models))

    async def hosted(self, name: str | None) -> Hosted:
        """The entry of ``name``, loaded (others unloaded first beyond ``max_loaded``), kept from
        unloading while idle until ``finished``."""
        entry = self.entry(name)
        if self.reaper is None:
            self.reaper = asyncio.ensure_future(self.reap())
        async with entry.lock:
            if entry.app is None:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, self.load, entry)
        entry.last_used, entry.expires_at = time.time(), None
        return entry

    def load(self, entry: Hosted) -> None:
        need = self.need(entry)
        with self.guard:
            self.make_room(entry, need)
            try:
                entry.app, entry.stop = self.make_app(entry.name, entry.source)
                entry.problem = None
            except Exception as exc:  # the reason goes to the client; the other models keep serving
                entry.problem = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                log.warning("model %s failed to load: %s", entry.name, entry.problem)
                raise APIError(f"the model {entry.name!r} failed to load: {entry.problem}", 500, "server_error",
                               "model", "model_load_failed") from None

    def facts(self, entry: Hosted) -> ModelFacts | None:
        """``entry``'s facts from its checkpoint (None when it cannot be read: loading it will say why)."""
        if entry.facts is None:
            try:
                entry.facts = model_facts(entry.source, self.tool_parser)
            except Exception as exc:
                log.info("cannot read %s's checkpoint: %s", entry.name, exc)
        return entry.facts

    def need(self, entry: Hosted) -> tuple[int, int] | None:
        """``(weights, KV budget)`` bytes of ``entry`` before it loads (None: unknown or no bound)."""
        facts = self.facts(entry) if self.max_memory is not None else None
        return None if facts is None else (facts.weights, kv_budget_of(facts.weights, self.max_kv_memory))

    @staticmethod
    def held(entry: Hosted) -> int:
        """Bytes a loaded model holds by the bound's count: its weights plus its engine's KV budget."""
        from mlxformer.engine.memory import weights_nbytes

        engine = entry.context.engine
        return weights_nbytes(engine.model) + (engine.budget.limit if engine.budget is not None else 0)

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of each model's weights in memory (0 when not loaded), for ``/metrics``."""
        from mlxformer.engine.memory import weights_nbytes

        out = {}
        for entry in list(self.models.values()):
            app = entry.app  # once: an unload may clear it meanwhile
            out[entry.name] = 0 if app is None else weights_nbytes(app.state.context.engine.model)
        return out

    def make_room(self, entry: Hosted, need: tuple[int, int] | None) -> None:
        """Unload idle models, least recently used first, until ``entry`` fits ``max_loaded`` and
        ``max_memory``; 507 when it cannot fit even alone, 503 when busy models leave no room."""
        total = None if need is None else sum(need)
        if total is not None and self.max_memory is not None and total > self.max_memory:
            raise APIError(
                f"the model {entry.name!r} needs {mib(total)} (weights {mib(need[0])} + KV budget {mib(need[1])}), "  # type: ignore[index]
                f"more than the server's --max-loaded-memory of {mib(self.max_memory)}", 507, "server_error",
                "model", "model_too_large")
        loaded = sorted((e for e in list(self.models.values()) if e.app is not None and e is not entry),
                        key=lambda e: e.last_used)

        def over(kept: list[Hosted]) -> bool:
            if len(kept) + 1 > self.max_loaded:
                return True
            return total is not None and self.max_memory is not None \
                and sum(self.held(e) for e in kept) + total > self.max_memory

        kept = list(loaded)
        for victim in loaded:
            if not over(kept):
                break
            if not victim.busy:
                self._unload(victim)
                kept.remove(victim)
        used = sum(self.held(e) for e in kept)
        if total is not None and self.max_memory is not None and used + total > self.max_memory:
            raise APIError(
                f"the model {entry.name!r} needs {mib(total)} and the busy models hold {mib(used)} of the server's "
                f"--max-loaded-memory of {mib(self.max_memory or 0)}; retry when they finish", 503, "server_error",
                "model", "model_memory_busy", headers={"Retry-After": "1"})

    async def context(self, name: str | None) -> ServerContext:
        return (await self.hosted(name)).context

    def finished(self, name: str | None, keep_alive: float | None) -> None:
        entry = self.entry(name)
        entry.last_used = time.time()
        keep = self.idle_unload if keep_alive is None else keep_alive
        entry.expires_at = None if keep is None or keep < 0 else entry.last_used + keep
        if keep == 0 and not entry.busy:
            self.unload(entry.name)

    def unload(self, name: str) -> bool:
        entry = self.models.get(name)
        if entry is None or entry.app is None:
            return False
        with self.guard:
            self._unload(entry)
        return True

    def _unload(self, entry: Hosted) -> None:
        if entry.stop is not None:
            entry.stop()  # its engine first: the model stays listed as loaded until it has stopped
        entry.app, entry.stop, entry.expires_at = None, None, None
        forget_fastapi_callables()
        gc.collect()
        import mlx.core as mx

        mx.clear_cache()
        trim_heap()
        log.info("unloaded %s", entry.name)

    async def reap(self) -> None:
        """Unload idle models whose keep-alive ran out (runs while the server does)."""
        while True:
            await asyncio.sleep(REAP_SECONDS)
            now = time.time()
            for entry in list(self.models.values()):
                if entry.app is not None and not entry.busy and entry.expires_at is not None \
                        and entry.expires_at <= now:
                    await asyncio.get_running_loop().run_in_executor(None, self.unload, entry.name)

    def add(self, name: str) -> None:
        if name not in self.models:
            self.models[name] = Hosted(name, name)  # loaded from the cache on first use
            log.info("serving %s (pulled)", name)

    def records(self) -> list[ModelRecord]:
        out = []
        for entry in list(self.models.values()):
            if entry.app is not None:
                out.append(loaded_record(entry.name, entry.source, entry.context, entry.expires_at))
            else:
                facts = self.facts(entry)  # from its checkpoint: no weights are loaded
                out.append(ModelRecord(entry.name, entry.source, "", "?", "", 0, False,
                                       facts.context_length if facts else None, None, entry.problem,
                                       facts.capabilities if facts else None))
        return out

    def close(self) -> None:
        """Unload every model."""
        for name in list(self.models):
            self.unload(name)


def forget_fastapi_callables() -> None:
    """Empty FastAPI's module-level caches of the endpoints and dependencies it has classified
    (``fastapi.dependencies.models``, 0.16x): they hold the unloaded app's route functions, whose
    closures hold its engine and weights. The others' entries are simply computed again."""
    from fastapi.dependencies import models

    for name in ("_is_gen_callable_cached", "_is_async_gen_callable_cached", "_is_coroutine_callable_cached"):
        cached = vars(models).get(name)
        if cached is not None:
            cached.cache_clear()


def trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's ``malloc_trim``; elsewhere
    nothing): an unloaded model's decoded buffers must not stay resident."""
    import ctypes
    import platform
    import sys

    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(None).malloc_trim(0)


def body_fields(body: bytes) -> tuple[str | None, Any]:
    """The ``model`` and ``keep_alive`` of a JSON request body (None when absent or not JSON)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None, None
    if not isinstance(data, dict):
        return None, None
    model = data.get("model")
    return (model if isinstance(model, str) else None), data.get("keep_alive")


class MultiModelApp:
    """The ASGI front of a several-model server (see the module docstring); ``shape``: an error
    body in the form the request's API uses (``app.api_shape``: Anthropic's on its routes). It
    runs behind the request guard, and checks ``api_key`` itself, so that neither a foreign
    ``Host``, an oversized body nor a missing key loads a model."""

    def __init__(self, front: FastAPI, host: MultiHost, front_paths: Callable[[str], bool],
                 shape: Callable[[str, int, dict[str, Any]], dict[str, Any]], api_key: str | None = None) -> None:
        self.front, self.host, self.front_paths, self.shape = front, host, front_paths, shape
        self.api_key = api_key

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.front_paths(scope["path"]):
            await self.front(scope, receive, send)
            return
        from mlxformer.server.ollama_protocol import keep_alive_seconds

        try:
            if self.api_key is not None and scope["path"] not in OPEN_PATHS:
                require_key(scope_headers(scope), self.api_key)
            body = await read_body(receive)
            name, keep_alive = body_fields(body) if scope["method"] == "POST" else (None, None)
            keep = keep_alive_seconds(keep_alive)
            entry = await self.host.hosted(name)
        except BodyTooLarge as exc:
            await send_error(send, 413, str(exc), "request_too_large", scope["path"], self.shape)
            return
        except APIError as exc:
            await send_json(send, exc.status, self.shape(scope["path"], exc.status, exc.body()), exc.headers)
            return
        replayed = [False]

        async def replay() -> dict[str, Any]:
            if not replayed[0]:
                replayed[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        try:
            assert entry.app is not None
            await entry.app(dict(scope), replay, send)  # a copy: the model's app puts itself in its scope
        finally:
            self.host.finished(entry.name, keep)


async def read_body(receive: Any) -> bytes:
    """A request's whole body (the guard's ``receive`` raises ``BodyTooLarge`` past the limit)."""
    chunks, more = [], True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


async def send_json(send: Any, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
    data = json.dumps(body).encode()
    extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *extra]})
    await send({"type": "http.response.body", "body": data})

