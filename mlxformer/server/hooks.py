"""Hooks for the request fields that other features serve: ``response_format`` (structured
output) and ``tools``. Until those land, anything beyond plain text is refused with a 400."""

from __future__ import annotations

from typing import Any

from mlxformer.sampling import TokenConstraint
from mlxformer.server.errors import bad_request
from mlxformer.server.protocol import ResponseFormat
from mlxformer.tokenizer import Tokenizer


def constraint_for(response_format: ResponseFormat | None, tokenizer: Tokenizer) -> TokenConstraint | None:
    """The per-request token constraint for ``response_format``: ``None`` for free text.

    ``json_object`` and ``json_schema`` are refused (400) until structured output is wired here.
    """
    if response_format is None or response_format.type == "text":
        return None
    raise bad_request(
        f"response_format {response_format.type!r} is not supported by this server yet",
        param="response_format", code="unsupported_response_format",
    )


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> None:
    """Refuse tool calling (400) unless no tools are offered or ``tool_choice`` is ``"none"``."""
    if not tools or tool_choice == "none":
        return
    raise bad_request("tool calling is not supported by this server yet", param="tools", code="unsupported_tools")
