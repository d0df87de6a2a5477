"""Ollama's API request bodies (``/api/chat``, ``/api/generate``, ``/api/show``, ``/api/pull``,
``/api/delete``) and their translation into the server's own terms: ``options`` into
``SamplingFields``, ``format`` into a ``ResponseFormat``, ``think`` into the turn's reasoning
switch and budget, ``keep_alive`` into seconds. Unknown fields and options are ignored, as
Ollama does."""

from __future__ import annotations

import re
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from mlxformer.server.errors import bad_request, validation_message
from mlxformer.server.protocol import ResponseFormat, SamplingFields
from mlxformer.server.turn import effort_budget

OLLAMA_VERSION = "0.12.0"  # the Ollama API version whose routes and fields these follow
# Ollama option -> SamplingFields field
OPTION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty", "seed": "seed", "stop": "stop"}
_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class OllamaBody(BaseModel):
    """A request body: unknown fields are ignored, types are strict (Ollama answers 400 to
    ``"stream": "no"`` or ``"keep_alive": true``)."""

    model_config = ConfigDict(extra="ignore", strict=True)


class OllamaMessage(OllamaBody):
    role: str
    content: Optional[str] = ""
    thinking: Optional[str] = None
    images: Optional[list[Any]] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_name: Optional[str] = None


class ChatBody(OllamaBody):
    model: str
    messages: list[OllamaMessage] = []
    tools: Optional[list[dict[str, Any]]] = None
    format: Union[str, dict[str, Any], None] = None
    options: Optional[dict[str, Any]] = None
    stream: bool = True
    think: Union[bool, str, None] = None
    keep_alive: Union[float, str, None] = None


class GenerateBody(OllamaBody):
    model: str
    prompt: Optional[str] = None
    suffix: Optional[str] = None
    system: Optional[str] = None
    raw: bool = False
    images: Optional[list[Any]] = None
    format: Union[str, dict[str, Any], None] = None
    options: Optional[dict[str, Any]] = None
    stream: bool = True
    think: Union[bool, str, None] = None
    keep_alive: Union[float, str, None] = None


class ModelBody(OllamaBody):
    """``/api/show``, ``/api/delete``, ``/api/pull``: a model name (``name`` is the old spelling)."""

    model: Optional[str] = None
    name: Optional[str] = None
    stream: bool = True

    def model_name(self) -> str:
        name = self.model or self.name
        if not name:
            raise bad_request("model is required", param="model")
        return name


def sampling_fields(model: str, options: dict[str, Any] | None) -> tuple[SamplingFields, int | None]:
    """``options`` as ``SamplingFields`` and the ``num_predict`` budget (``None``: no limit but
    the context; Ollama's -1 and -2 both mean that here)."""
    options = options or {}
    values = {field: options[key] for key, field in OPTION_FIELDS.items() if options.get(key) is not None}
    predict = options.get("num_predict")
    if predict is not None and (not isinstance(predict, int) or isinstance(predict, bool) or predict == 0
                                or predict < -2):
        raise bad_request(f"options.num_predict must be a positive integer, -1 or -2 (got {predict!r})",
                          param="options.num_predict")
    try:
        return SamplingFields(model=model, **values), (predict if predict and predict > 0 else None)
    except ValidationError as exc:
        message, param = validation_message(list(exc.errors()))
        raise bad_request(f"options: {message}", param=f"options.{param}" if param else "options") from exc


def response_format(value: str | dict[str, Any] | None) -> ResponseFormat | None:
    """``format``: ``"json"`` (any JSON object) or a JSON Schema; ``""``/None: free text."""
    if value in (None, ""):
        return None
    if value == "json":
        return ResponseFormat(type="json_object")
    if isinstance(value, dict):
        return ResponseFormat(type="json_schema", json_schema={"name": "output", "schema": value})
    raise bad_request(f"format must be \"json\" or a JSON Schema object (got {str(value)[:40]!r})", param="format")


def thinking(think: bool | str | None) -> tuple[bool | None, int | None]:
    """``think`` as ``(reasoning on/off or the template's default, budget)``: ``true``/``false``,
    or an effort ``"low"``/``"medium"``/``"high"``."""
    if think is None or isinstance(think, bool):
        return think, None
    return True, effort_budget(think)


def keep_alive_seconds(value: float | str | None) -> float | None:
    """Ollama's ``keep_alive``: seconds as a number, or a Go duration (``"5m"``, ``"1h30m"``,
    ``"0"``); negative: forever (``-1.0``); ``None``: the server's default."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return -1.0 if value < 0 else float(value)
    text = str(value).strip()
    try:
        number = float(text)
        return -1.0 if number < 0 else number
    except ValueError:
        pass
    pieces = _DURATION.findall(text)
    if not pieces or "".join(n + u for n, u in pieces) != text:
        raise bad_request(f"keep_alive must be seconds or a duration like \"5m\" (got {text[:40]!r})",
                          param="keep_alive")
    seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in pieces)
    return -1.0 if seconds < 0 else seconds


def chat_messages(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    """Ollama messages as the OpenAI-style dicts a ``Turn`` takes (tool calls get ids, tool
    results the id of the call they answer, matched by tool name)."""
    out: list[dict[str, Any]] = []
    pending: dict[str, list[str]] = {}  # tool name -> ids of its unanswered calls
    for number, m in enumerate(messages):
        if m.images:
            raise bad_request("images are not supported: this server serves a text model", param="messages")
        message: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.thinking:
            message["reasoning_content"] = m.thinking
        if m.tool_calls:
            calls = []
            for index, call in enumerate(m.tool_calls):
                function = call.get("function") or {}
                call_id = f"call_{number}_{index}"
                pending.setdefault(str(function.get("name")), []).append(call_id)
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": function.get("name"), "arguments": function.get("arguments") or {}}})
            message["tool_calls"] = calls
        if m.role == "tool":
            ids = pending.get(str(m.tool_name), [])
            message["tool_call_id"] = ids.pop(0) if ids else f"call_{number}"
            if m.tool_name:
                message["name"] = m.tool_name
        out.append(message)
    return out
