"""What the agent APIs' routes (Anthropic Messages, Responses, metadata) get from the app: the
served model and its traits, and the app's own ways to submit a request, stream a response and
collect a whole one (so that leases, cancellation and disconnects work as on every route)."""

from __future__ import annotations

import json
import logging
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response

from mlxformer.engine import GenerationRequest, TokenEvent
from mlxformer.server.errors import APIError
from mlxformer.server.responses import Collected
from mlxformer.server.translate import ServedModel
from mlxformer.server.turn import Traits

log = logging.getLogger("mlxformer.server")


@dataclass(frozen=True)
class Hosting:
    served: ServedModel
    traits: Traits
    submit: Callable[[GenerationRequest], Any]  # -> a lease (``app.Lease``)
    open_stream: Callable[[AsyncIterator[str], Any], Response]  # (SSE text, lease) -> response
    collect: Callable[[Any, Request], Awaitable[Collected]]  # (lease, request) -> all events
    any_model_name: bool = True  # serve whatever model name a request gives (Claude Code sends claude-*)

    def check_model(self, requested: str | None) -> None:
        """404 for another model's name, when the server is told to be strict about names."""
        if not self.any_model_name and requested and requested != self.served.name:
            raise APIError(f"the model {requested!r} does not exist; this server serves {self.served.name!r}",
                           404, "invalid_request_error", "model", "model_not_found")


async def frames(
    lease: Any,
    on_event: Callable[[TokenEvent], list[str]],
    on_error: Callable[[str], list[str]],
) -> AsyncIterator[str]:
    """The SSE frames ``on_event`` makes of each of a request's events; a failure after the stream
    started is reported in-band with ``on_error``. The request is released however this ends."""
    try:
        async with aclosing(lease.handle.aiter()) as events:
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
