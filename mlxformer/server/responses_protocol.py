"""The OpenAI Responses wire format (``POST /v1/responses``): the request schema, and the input
items read from it. Unknown fields are ignored; hosted tools (web search, file search, code
interpreter, computer use) are ignored with a warning (``responses_state.tool_set``)."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field, model_validator

from mlxformer.server.protocol import Lenient, require_schema


TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "reasoning_text", "summary_text")


class ContentPart(Lenient):
    type: str  # input_text, output_text, text, refusal, ... (images are refused)
    text: Optional[str] = None


class InputItem(Lenient):
    """One ``input`` item: a message (``role`` + ``content``), ``function_call``,
    ``function_call_output`` or ``reasoning``."""

    type: Optional[str] = None  # "message" (or absent with a role), "function_call", ...
    role: Optional[Literal["user", "assistant", "system", "developer"]] = None
    content: Union[str, list[ContentPart], None] = None
    call_id: Optional[str] = None
    name: Optional[str] = None
    arguments: Optional[str] = None
    output: Union[str, list[ContentPart], None] = None
    summary: Optional[list[ContentPart]] = None
    encrypted_content: Optional[str] = None  # a reasoning item's, as this server sealed it
    input: Optional[str] = None  # a custom tool call's input

    def text(self) -> str:
        """A message's content as one string (text parts joined; other parts are a 400)."""
        if isinstance(self.content, str) or self.content is None:
            return self.content or ""
        if bad := [p.type for p in self.content if p.type not in TEXT_PARTS]:
            raise ValueError(f"{bad[0]} content is not supported: this server serves a text model")
        return "".join(p.text or "" for p in self.content)

    def output_text(self) -> str:
        if isinstance(self.output, str) or self.output is None:
            return self.output or ""
        return "".join(p.text or "" for p in self.output)


class TextFormat(Lenient):
    type: Literal["text", "json_schema", "json_object"]
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None

    @model_validator(mode="after")
    def schema_given(self) -> "TextFormat":
        require_schema(self.type, self.schema_, "text.format.schema")
        return self


class TextConfig(Lenient):
    format: Optional[TextFormat] = None


class ReasoningConfig(Lenient):
    effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None
    summary: Optional[str] = None


class ResponsesRequest(Lenient):
    model: Optional[str] = None
    input: Union[str, list[InputItem]]
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    parallel_tool_calls: Optional[bool] = None
    store: bool = True
    stream: bool = False
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    include: Optional[list[str]] = None  # "reasoning.encrypted_content": reasoning items carry it


class ResponseObject(BaseModel):
    """The reply of ``POST /v1/responses`` (documentation: the route builds it as a dict)."""

    id: str
    object: Literal["response"]
    created_at: float
    model: str
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    output: list[dict[str, Any]]  # message, reasoning and function_call items
    incomplete_details: Optional[dict[str, Any]]
    error: Optional[dict[str, Any]]
    instructions: Optional[str]
    tools: list[dict[str, Any]]
    tool_choice: Union[str, dict[str, Any]]
    parallel_tool_calls: bool
    temperature: Optional[float]
    top_p: Optional[float]
    max_output_tokens: Optional[int]
    previous_response_id: Optional[str]
    store: bool
    metadata: dict[str, Any]
    text: dict[str, Any]
    usage: Optional[dict[str, Any]]


class ResponseStreamEvent(BaseModel):
    """One event of a streamed response: ``response.created``, ``response.output_text.delta``, ..."""

    type: str
    sequence_number: int
