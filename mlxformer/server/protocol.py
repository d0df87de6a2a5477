"""The OpenAI-compatible wire format: pydantic request and response schemas.

Requests validate types and ranges here (a failure becomes a 400 with an OpenAI error body);
what needs the model or tokenizer to check (context length, token ids) is checked in
``translate``. Unknown request fields are ignored, as vLLM and mlx-lm do.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from mlxformer.sampling.options import MAX_PENALTY, MAX_SEED, RANDOM_SEED

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20


class Lenient(BaseModel):
    """A request object: extra fields are ignored; types are strict (no ``false`` for ``0``, no
    ``"1"`` for ``1``) and floats finite."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(Lenient):
    include_usage: bool = False


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class CalledFunction(Lenient):
    name: str
    arguments: Union[str, dict[str, Any]] = ""  # OpenAI's JSON text (an object is taken too)


class EarlierCall(Lenient):
    """One of an assistant turn's earlier ``tool_calls``."""

    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[EarlierCall]] = None  # an assistant turn's earlier calls
    tool_call_id: Optional[str] = None  # a tool turn: which call this result answers
    reasoning_content: Optional[str] = None  # an assistant turn's reasoning (templates keep or drop it)

    @model_validator(mode="after")
    def content_given(self) -> "ChatMessage":
        """Only an assistant turn may come without content (OpenAI's rule: its tool calls say it all)."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it (content as one string)."""
        message = {"role": self.role, "content": self.text()}
        calls = None if self.tool_calls is None else [c.model_dump(exclude_none=True) for c in self.tool_calls]
        extra = {"name": self.name, "tool_calls": calls, "tool_call_id": self.tool_call_id,
                 "reasoning_content": self.reasoning_content}
        return {**message, **{k: v for k, v in extra.items() if v is not None}}

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def require_schema(kind: str, schema: Any, where: str) -> None:
    """A ``json_schema`` output format must carry its schema (an object) at ``where``."""
    if kind == "json_schema" and not isinstance(schema, dict):
        raise ValueError(f'type "json_schema" needs {where}, a JSON schema object')


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def schema_given(self) -> "ResponseFormat":
        require_schema(self.type, (self.json_schema or {}).get("schema"), "json_schema.schema")
        return self


def bounds(minimum: float | None = None, maximum: float | None = None, *, above: float | None = None,
           below: float | None = None) -> Any:
    """A field's documented range (``above``/``below``: exclusive), for the OpenAPI document only:
    the values are checked by ``mlxformer.sampling.options.SamplingSettings``, the one validation of
    sampling options for every entry point."""
    rule = {"minimum": minimum, "maximum": maximum, "exclusiveMinimum": above, "exclusiveMaximum": below}
    return Field(default=None, json_schema_extra={k: v for k, v in rule.items() if v is not None})


class LoraPick(Lenient):
    """One adapter a request runs with (llama-server's ``lora`` entries): its position in
    ``GET /lora-adapters`` (or its name) and its scale."""

    id: Union[int, str]
    scale: float = 1.0


class SamplingFields(Lenient):
    """The fields shared by chat and text completions."""

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = bounds(minimum=0.0)
    top_p: Optional[float] = bounds(above=0.0, maximum=1.0)
    top_k: Optional[int] = bounds(minimum=-1, maximum=2**31 - 1)  # -1 or 0: off (vLLM / OpenAI-style)
    min_p: Optional[float] = bounds(minimum=0.0, below=1.0)
    seed: Optional[int] = bounds(minimum=RANDOM_SEED, maximum=MAX_SEED)  # -1: a random seed (llama.cpp)
    stop: Union[str, list[str], None] = None
    presence_penalty: Optional[float] = bounds(minimum=-MAX_PENALTY, maximum=MAX_PENALTY)
    frequency_penalty: Optional[float] = bounds(minimum=-MAX_PENALTY, maximum=MAX_PENALTY)
    repetition_penalty: Optional[float] = bounds(above=0.0)
    logit_bias: Optional[dict[str, float]] = None  # token id -> bias in [-100, 100]
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    return_progress: bool = False  # llama-server's: stream prompt_progress objects while the prompt is prefilled
    user: Optional[str] = None
    lora: Optional[list[LoraPick]] = None  # the adapters to run with (``serve --lora``); model "BASE:NAME" picks one too

    def stop_strings(self) -> list[str]:
        """``stop`` as a list of non-empty strings."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # e.g. {"enable_thinking": false}
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None
    reasoning_budget: Optional[int] = Field(default=None, ge=0)  # most reasoning tokens before </think> is forced


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = Field(default=None, ge=0)  # 0: only with echo (score the prompt)
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: Optional[str] = None
    response_format: Optional[ResponseFormat] = None  # vLLM's extension: structured output for a raw prompt


# --- responses -------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    """An OpenAI-style object id, e.g. ``chatcmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    """Speculative decoding (``serve --prompt-lookup / --draft-model``): proposed tokens the model
    accepted and rejected (OpenAI's predicted-output fields)."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None
    completion_tokens_details: Optional[CompletionTokensDetails] = None
    max_tokens: Optional[int] = Field(None, description=(
        "the reply's max tokens when fewer than asked: a missing max_tokens (the rest of the context) cut to what "
        "the server's KV budget holds for this prompt; absent otherwise (also sent as x-mlxformer-max-tokens)"))

    @model_serializer(mode="wrap")
    def _without_unset_max_tokens(self, handler: SerializerFunctionWrapHandler):  # type: ignore[no-untyped-def]
        """Leaves ``max_tokens`` out unless set (no return annotation: it would replace the schema)."""
        data = handler(self)
        if data.get("max_tokens") is None:
            data.pop("max_tokens", None)
        return data


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]] = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    reasoning_content: Optional[str] = None  # vLLM / DeepSeek's name
    reasoning: Optional[str] = None  # the same, as Open WebUI and mlx-lm clients read it
    tool_calls: Optional[list[dict[str, Any]]] = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)  # the echoed prompt's first: null
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "mlxformer"
    context_length: int
    capabilities: Optional[dict[str, Any]] = None  # chat, tools (and their parser), reasoning, structured_output


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
