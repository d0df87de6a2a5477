"""What the agent APIs' routes (Anthropic Messages, Responses) share beyond the ``ServerContext``:
the model-name policy, and SSE streams of named events made from the engine's events."""

from __future__ import annotations

import json
import logging
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable, Sequence

from mlxformer.engine import TokenEvent
from mlxformer.server.context import ServerContext
from mlxformer.server.errors import APIError
from mlxformer.server.streaming import Lease

log = logging.getLogger("mlxformer.server")


def check_model(ctx: ServerContext, requested: str | None) -> None:
    """404 for another model's name, when the server is told to be strict about names."""
    if not ctx.any_model_name and requested and requested != ctx.served.name:
        raise APIError(f"the model {requested!r} does not exist; this server serves {ctx.served.name!r}",
                       404, "invalid_request_error", "model", "model_not_found")


async def frames(
    lease: Lease,
    on_event: Callable[[TokenEvent], list[str]],
    on_error: Callable[[str], list[str]],
    opening: Sequence[str] = (),
) -> AsyncIterator[str]:
    """``opening`` (sent at once: the client sees the request admitted before a long prefill),
    then the SSE frames ``on_event`` makes of each of a request's events; a failure after the
    stream started is reported in-band with ``on_error``. The request is released however this ends."""
    try:
        for frame in opening:
            yield frame
        async with aclosing(lease.events()) as events:
            async for event in events:
                lease.finished = lease.finished or event.finish_reason is not None
                for frame in on_event(event):
                    yield frame
    except Exception as exc:  # the stream has started: report in-band
        log.exception("generation failed")
        for frame in on_error(f"generation failed ({type(exc).__name__})"):
            yield frame
    finally:
        lease.release()


def named_event(payload: dict[str, Any]) -> str:
    """One server-sent event named by its payload's ``type`` (Anthropic's and Responses' streams)."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"
