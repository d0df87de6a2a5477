"""A submitted request held by one HTTP response: streamed as SSE or collected whole, and
cancelled however the response ends (finished, client gone, error)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from mlxformer.engine import RequestHandle, TokenEvent
from mlxformer.server.errors import APIError
from mlxformer.server.chat_output import ChunkMaker, Collected, collect, error_event, sse
from mlxformer.server.sse import frames

DISCONNECT_POLL_SECONDS = 0.25  # how often a non-streamed request checks that its client is still there
SSE_MEDIA_TYPE = "text/event-stream"
DONE = "data: [DONE]\n\n"


class InFlight:
    """Counts the requests the engine is working on for this app (reported by /health)."""

    def __init__(self) -> None:
        self.count = 0


MAX_TOKENS_HEADER = "x-mlxformer-max-tokens"  # the reply's max tokens, when fewer than asked (``Lease.cut``)


class Lease:
    """A submitted request held by one HTTP response: ``release`` (idempotent) cancels it unless
    it finished, and stops counting it; ``on_finish`` sees its last event. ``asked``: the max
    tokens the client asked for (or the default, the rest of the context)."""

    def __init__(self, handle: RequestHandle, inflight: InFlight, asked: int,
                 on_finish: Callable[[TokenEvent], None] | None = None) -> None:
        self.handle, self.inflight, self.asked, self.on_finish = handle, inflight, asked, on_finish
        self.finished = self.released = False
        self.score_only = False  # max_tokens 0: the reply keeps none of the generated tokens
        inflight.count += 1

    @property
    def cut(self) -> int | None:
        """The reply's max tokens when fewer than ``asked`` (clamped to the context's room, or a
        default cut to what the KV budget holds), else None: reported as ``usage.max_tokens``
        and the ``MAX_TOKENS_HEADER`` of every generation route."""
        return self.handle.max_tokens if self.handle.max_tokens < self.asked else None

    @property
    def headers(self) -> dict[str, str]:
        """The response headers saying so (``cut``): known at submit, before the first byte."""
        return {MAX_TOKENS_HEADER: str(self.cut)} if self.cut is not None else {}

    async def events(self) -> AsyncIterator[TokenEvent]:
        """The request's events (with ``score_only``, one final event carrying no token)."""
        async with aclosing(self.handle.aiter()) as events:
            async for event in events:
                if self.score_only:
                    if event.finish_reason is None:
                        continue
                    event = dataclasses.replace(event, text="", token=None, logprob=None, top_logprobs=None,
                                                finish_reason="length", completion_tokens=0)
                if event.finish_reason is not None and self.on_finish is not None:
                    self.on_finish(event)
                yield event

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.inflight.count -= 1
        if not self.finished:
            self.handle.cancel()


class EventStream(StreamingResponse):
    """An SSE response that releases its request however the response ends (also when the
    client is gone before the first chunk, when the chunk generator never runs), with the
    lease's headers."""

    def __init__(self, chunks: AsyncIterator[str], lease: Lease) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **lease.headers}
        super().__init__(chunks, media_type=SSE_MEDIA_TYPE, headers=headers)
        self.lease = lease

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.lease.release()


def stream(
    lease: Lease,
    make: ChunkMaker,
    first: BaseModel | None,
    usage_chunk: Callable[[TokenEvent | None], BaseModel] | None,
) -> AsyncIterator[str]:
    """The Chat Completions / Completions stream (``sse.frames``): ``first`` at once, a chunk per
    event that makes one, then the usage chunk (if asked) and ``[DONE]``; every chunk has the
    same ``created`` time."""
    last: list[TokenEvent | None] = [None]
    created = int(time.time())
    include_usage = usage_chunk is not None

    def event_of(chunk: BaseModel) -> str:
        if hasattr(chunk, "created"):
            chunk.created = created  # type: ignore[attr-defined]
        return sse(chunk, include_usage)

    def on_event(event: TokenEvent) -> list[str]:
        last[0] = event
        chunk = make(event)
        return [event_of(chunk)] if chunk is not None else []

    def closing() -> list[str]:
        return [*([event_of(usage_chunk(last[0]))] if usage_chunk is not None else []), DONE]

    def on_error(message: str) -> list[str]:
        return [error_event(message), DONE]

    return frames(lease, on_event, on_error, [event_of(first)] if first is not None else [], closing)


async def collect_unless_gone(lease: Lease, request: Request) -> Collected:
    """All of a request's events; cancels the request if the client disconnects meanwhile."""
    task = asyncio.ensure_future(collect(lease.events()))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                lease.finished = True
                return dataclasses.replace(task.result(), max_tokens=lease.cut)
            if await request.is_disconnected():
                raise APIError("client disconnected", 499, "invalid_request_error", None, "client_closed_request")
    finally:
        lease.release()
        if not task.done():
            task.cancel()
