"""What the Responses API keeps and hands back between requests: stored responses (for
``GET``/``DELETE /v1/responses/{id}`` and ``previous_response_id``, least recently used out),
reasoning as ``encrypted_content`` (opaque to the client, read back when it returns), and the
tools a request names, flattened to the function tools a local model can call."""

from __future__ import annotations

import base64
import binascii
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from mlxformer.server.errors import APIError, bad_request

log = logging.getLogger("mlxformer.server")

STORE_LIMIT = 256  # responses kept (oldest dropped first)
OPAQUE_PREFIX = "mlxformer:"  # our encrypted_content: not encrypted, but opaque to clients


@dataclass
class Stored:
    """A stored response: its conversation (chat messages, instructions excluded, the reply
    last), and the response object as it was returned."""

    messages: list[dict[str, Any]]
    response: dict[str, Any]


class ResponseStore:
    """The most recent ``store: true`` responses, bounded (least recently used out)."""

    def __init__(self, limit: int = STORE_LIMIT) -> None:
        self.limit, self.items = limit, OrderedDict[str, Stored]()

    def get(self, response_id: str, param: str | None = "previous_response_id") -> Stored:
        if response_id not in self.items:
            what = "previous response" if param else "response"
            raise APIError(f"{what} {response_id!r} not found (only the last {self.limit} are kept)", 404,
                           "invalid_request_error", param, "previous_response_not_found" if param else "not_found")
        self.items.move_to_end(response_id)
        return self.items[response_id]

    def put(self, response_id: str, stored: Stored) -> None:
        self.items[response_id] = stored
        while len(self.items) > self.limit:
            self.items.popitem(last=False)

    def delete(self, response_id: str) -> None:
        self.get(response_id, param=None)
        del self.items[response_id]


def seal(reasoning: str) -> str:
    """A reasoning text as an opaque ``encrypted_content`` value."""
    return OPAQUE_PREFIX + base64.b64encode(json.dumps({"text": reasoning}).encode()).decode()


def unseal(value: str | None) -> str:
    """The reasoning text of our ``encrypted_content`` ("" for another server's value)."""
    if not value or not value.startswith(OPAQUE_PREFIX):
        return ""
    try:
        return str(json.loads(base64.b64decode(value[len(OPAQUE_PREFIX):]))["text"])
    except (binascii.Error, ValueError, KeyError, TypeError):
        return ""


@dataclass
class ToolSet:
    """A request's tools as chat-completions function tools: ``namespaces`` maps a function
    that came from a ``namespace`` tool to that namespace, ``ignored`` names the hosted tools
    (web search, file search, ...) that a local server cannot run."""

    tools: list[dict[str, Any]] | None = None
    namespaces: dict[str, str] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)

    def warnings(self) -> list[str]:
        return [f"the hosted tool {kind!r} is not available on this server and was ignored" for kind in self.ignored]


def function_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool}}


def tool_set(tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None) -> ToolSet:
    """Function tools kept, ``namespace`` tools flattened into theirs, hosted tools ignored (a
    400 when ``tool_choice`` names one: the request cannot be answered without it)."""
    out = ToolSet()
    if isinstance(choice, dict) and choice.get("type") not in (None, "function"):
        raise bad_request(f"the hosted tool {choice.get('type')!r} is not available on this server",
                          param="tool_choice")
    if not tools:
        return out
    functions = []
    for tool in tools:
        kind = tool.get("type")
        if kind == "function":
            functions.append(function_tool(tool))
        elif kind == "namespace":
            for inner in tool.get("tools") or []:
                if inner.get("type") == "function":
                    functions.append(function_tool(inner))
                    out.namespaces[inner["name"]] = tool.get("name", "")
        else:
            out.ignored.append(str(kind))
    if out.ignored:
        log.warning("ignored hosted tools: %s", ", ".join(out.ignored))
    out.tools = functions or None
    return out
