"""The Anthropic Messages wire format (``POST /v1/messages``): pydantic request schemas and the
Anthropic-shaped error body. Unknown fields are ignored (as for the OpenAI routes)."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field

from mlxformer.server.protocol import Lenient

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
               429: "rate_limit_error", 499: "invalid_request_error", 503: "overloaded_error"}


class ContentBlock(Lenient):
    """One content block of a message: ``text``, ``tool_use``, ``tool_result``, ``thinking``
    (``image`` and ``document`` are refused: this server serves text models)."""

    type: str  # text, tool_use, tool_result, thinking; image and document are refused, others ignored
    text: Optional[str] = None
    id: Optional[str] = None
    name: Optional[str] = None
    input: Optional[dict[str, Any]] = None
    tool_use_id: Optional[str] = None
    content: Union[str, list["ContentBlock"], None] = None
    is_error: Optional[bool] = None
    thinking: Optional[str] = None

    def plain(self) -> str:
        """The text of a text block, or of a tool result's content."""
        if self.type == "text":
            return self.text or ""
        if isinstance(self.content, str):
            return self.content
        return "".join(b.plain() for b in self.content or [] if b.type == "text")


class Message(Lenient):
    role: Literal["user", "assistant", "system"]  # Claude Code sends system messages mid-conversation
    content: Union[str, list[ContentBlock]]

    def blocks(self) -> list[ContentBlock]:
        return [ContentBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class Tool(Lenient):
    name: str
    description: Optional[str] = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    type: Optional[str] = None  # "custom" or absent; server tools (web search, ...) are refused


class ToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class Thinking(Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = Field(default=None, ge=0)


class OutputFormat(Lenient):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Lenient):
    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = None
    format: Optional[OutputFormat] = None


class TokenCountRequest(Lenient):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: Union[str, list[ContentBlock], None] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    output_config: Optional[OutputConfig] = None


class MessagesRequest(TokenCountRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    temperature: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=0)
    metadata: Optional[dict[str, Any]] = None


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """The error body of the Messages routes (documentation: ``anthropic_error`` builds it)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int


class MessageResponse(BaseModel):
    """The reply of ``POST /v1/messages`` (documentation: the route builds it as a dict)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]  # text, thinking and tool_use blocks
    stop_reason: Optional[Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]]
    stop_sequence: Optional[str]
    usage: MessageUsage


class MessageStreamEvent(BaseModel):
    """One event of a streamed reply: ``message_start``, ``content_block_*``, ``message_delta``, ..."""

    type: str


class TokenCount(BaseModel):
    input_tokens: int


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}`` for an HTTP status."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
