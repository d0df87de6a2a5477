"""Keeping a server-sent event stream alive while a long prompt is prefilled.

``keepalive`` wraps any route's SSE chunks: while no chunk comes for ``ping_seconds`` it sends an
SSE comment line (``: ping``), which every SSE client ignores and every proxy counts as traffic,
so clients with read timeouts do not give up during a long prefill. With a ``progress`` poll (a
request asking for llama-server's ``return_progress``), each change of the prompt's progress is
sent as soon as it is seen, as llama-server's ``prompt_progress`` object.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator, Callable

from mlxformer.engine import RequestHandle
from mlxformer.engine.sequence import Status

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
