"""Server-sent events for every streaming route (Chat Completions, Completions, Responses,
Messages): one loop (``frames``) turns a request's engine events into the frames the route's
callbacks make, and ``keepalive`` keeps the stream alive while a long prompt is prefilled.

``frames`` sends the route's opening frames at once (the request is admitted: Anthropic's
``message_start``, Responses' ``response.created``, the first chat chunk), then each event's
frames, then the closing frames (usage, ``[DONE]``); a failure after the stream started is
reported in-band; the request is released however the stream ends.

``keepalive`` wraps any route's SSE chunks: while no chunk comes for ``ping_seconds`` it sends an
SSE comment line (``: ping``), which every SSE client ignores and every proxy counts as traffic,
so clients with read timeouts do not give up during a long prefill. With a ``progress`` poll (a
request asking for llama-server's ``return_progress``), each change of the prompt's progress is
sent as soon as it is seen, as llama-server's ``prompt_progress`` object.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable, Protocol, Sequence

from mlxformer.engine import RequestHandle, TokenEvent
from mlxformer.engine.request_state import Status



class Lease(Protocol):
    """A submitted request held by one response, as a stream reads it (``streaming.Lease``)."""

    finished: bool

    def events(self) -> AsyncIterator[TokenEvent]:
        """The request's events."""
        ...

    def release(self) -> None:
        """Cancel the request unless it finished (idempotent)."""
        ...

log = logging.getLogger("mlxformer.server")

PING = ": ping\n\n"
SSE_PING_SECONDS = 5.0  # the default keep-alive interval
PROGRESS_POLL_SECONDS = 0.25


async def keepalive(
    chunks: AsyncIterator[str], ping_seconds: float | None, progress: Callable[[], str | None] | None = None,
    ping: str = PING,
) -> AsyncIterator[str]:
    """``chunks``, with ``ping`` (default: the comment ``PING``; Anthropic's stream sends its own
    ``ping`` event) after every ``ping_seconds`` without one (None or 0: never) and, while
    waiting, ``progress()``'s event whenever it returns one."""
    if not ping_seconds and progress is None:
        async for chunk in chunks:
            yield chunk
        return
    source = chunks.__aiter__()
    pending: asyncio.Future[str] | None = None
    last = time.monotonic()
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(source.__anext__())
            wait = PROGRESS_POLL_SECONDS if progress is not None else ping_seconds
            if ping_seconds:
                wait = min(wait, max(0.0, last + ping_seconds - time.monotonic()))  # type: ignore[type-var]
            done, _ = await asyncio.wait({pending}, timeout=wait)
            if done:
                try:
                    chunk = pending.result()
                except StopAsyncIteration:
                    return
                pending = None
            elif progress is not None and (event := progress()) is not None:
                chunk = event
            elif ping_seconds and time.monotonic() - last >= ping_seconds:
                chunk = ping
            else:
                continue
            yield chunk
            last = time.monotonic()
    finally:
        if pending is not None and not pending.done():
            pending.cancel()  # the source's own cleanup (cancelling its request) runs now
            with contextlib.suppress(BaseException):
                await pending


def prompt_progress(handle: RequestHandle, event: Callable[[dict[str, int]], str]) -> Callable[[], str | None]:
    """A ``progress`` poll for ``keepalive``: ``event({"total", "cache", "processed", "time_ms"})``
    (llama-server's ``prompt_progress``) each time more of the request's prompt is processed."""
    sequence = handle.sequence
    start = time.monotonic()
    seen = -1

    def poll() -> str | None:
        nonlocal seen
        processed = sequence.processed
        if sequence.status is not Status.PREFILLING or processed == seen:
            return None
        seen = processed
        return event({
            "total": len(sequence.prompt), "cache": sequence.cached_tokens, "processed": processed,
            "time_ms": int(1000 * (time.monotonic() - start)),
        })

    return poll


def named_event(payload: dict[str, Any]) -> str:
    """One server-sent event named by its payload's ``type`` (Anthropic's and Responses' streams)."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def frames(
    lease: Lease,
    on_event: Callable[[TokenEvent], list[str]],
    on_error: Callable[[str], list[str]],
    opening: Sequence[str] = (),
    closing: Callable[[], list[str]] | None = None,
) -> AsyncIterator[str]:
    """``opening`` (sent at once: the client sees the request admitted before a long prefill),
    the frames ``on_event`` makes of each of a request's events, then ``closing()``'s; a failure
    after the stream started is reported in-band with ``on_error``. If the client goes away (the
    response task is cancelled) the request is cancelled: it is released however this ends."""
    try:
        for frame in opening:
            yield frame
        async with aclosing(lease.events()) as events:
            async for event in events:
                lease.finished = lease.finished or event.finish_reason is not None
                for frame in on_event(event):
                    yield frame
        for frame in closing() if closing is not None else []:
            yield frame
    except Exception as exc:  # the stream has started: report in-band
        log.exception("generation failed")
        for frame in on_error(f"generation failed ({type(exc).__name__})"):
            yield frame
    finally:
        lease.release()
