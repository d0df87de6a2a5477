"""What the agent APIs' routes (Anthropic Messages, Responses) share beyond the ``ServerContext``:
the model-name policy (their streams: ``sse.frames`` and ``sse.named_event``)."""

from __future__ import annotations

from mlxformer.server.context import ServerContext
from mlxformer.server.errors import APIError


def check_model(ctx: ServerContext, requested: str | None) -> None:
    """404 for another model's name, when the server is told to be strict about names."""
    if not ctx.any_model_name and requested and ctx.served.base_name(requested) != ctx.served.name:
        raise APIError(f"the model {requested!r} does not exist; this server serves {ctx.served.name!r}",
                       404, "invalid_request_error", "model", "model_not_found")
