"""OpenAI's ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions`` over a ``ServerContext``.

Each generation route prepares its request on the context's thread pool (``prepare``), submits
it, and streams (SSE) or collects the engine's events.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from mlxformer.engine import TokenEvent
from mlxformer.server.context import ServerContext
from mlxformer.server.meta_api import anthropic_models, model_card
from mlxformer.server.openapi import GENERATION, error_responses, streamed_ok
from mlxformer.server.prepare import prepare_chat, prepare_completion
from mlxformer.server.protocol import (
    ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, CompletionLogprobs, CompletionRequest,
    CompletionResponse, ModelList, new_id,
)
from mlxformer.server.chat_output import (
    chat_chunk_maker, chat_response, completion_chunk_maker, completion_response, echo_logprobs, sse, usage_of,
)
from mlxformer.server.hosting import check_model
from mlxformer.server.reply import whole_reply
from mlxformer.server.streaming import collect_unless_gone, stream


def openai_router(ctx: ServerContext) -> APIRouter:
    """The OpenAI routes (mounted under ``/v1`` behind the API key by ``create_app``)."""
    router = APIRouter()
    served, text = ctx.served, ctx.text

    @router.get("/models", response_model=ModelList, responses=error_responses([500]))
    async def models(request: Request) -> Any:
        if "anthropic-version" in request.headers:  # the Anthropic SDK's models.list()
            return JSONResponse(anthropic_models(ctx))
        card = model_card(ctx)
        adapters = served.adapters.names if served.adapters is not None else []  # each as BASE:NAME
        return ModelList(data=[card] + [card.model_copy(update={"id": f"{card.id}:{name}"}) for name in adapters])

    @router.post("/chat/completions", response_model=ChatCompletionResponse,
                 responses={**streamed_ok(ChatCompletionResponse, ChatCompletionChunk), **error_responses(GENERATION)})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(ctx, body.model)
        name = served.reply_name(body.model)
        prepared = await ctx.prepare(lambda: prepare_chat(body, served, ctx.traits))
        lease = ctx.submit(prepared.request)
        request_id = new_id("chatcmpl")
        if body.stream:
            make = chat_chunk_maker(request_id, name, text, body.logprobs, prepared.parser())
            first = ChatCompletionChunk.model_validate({
                "id": request_id, "model": name,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
            })

            def usage_chunk(last: TokenEvent | None) -> BaseModel:
                return ChatCompletionChunk(id=request_id, model=name, choices=[], usage=usage_of(last, lease.cut))

            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def progress_chunk(progress: dict[str, int]) -> str:
                return sse({**first.model_dump(exclude_none=True), "choices": [], "prompt_progress": progress})

            chunks = stream(lease, make, first, usage_chunk if include_usage else None)
            return ctx.event_stream(chunks, lease, progress_chunk if body.return_progress else None)
        result = await collect_unless_gone(lease, request)
        reply = whole_reply(prepared.parser(), result.events)
        return JSONResponse(chat_response(request_id, name, result, reply, text, body.logprobs).model_dump(),
                            headers=lease.headers)

    @router.post("/completions", response_model=CompletionResponse,
                 responses={**streamed_ok(CompletionResponse, CompletionResponse), **error_responses(GENERATION)})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(ctx, body.model)
        name = served.reply_name(body.model)
        prepared = await ctx.prepare(lambda: prepare_completion(body, served))
        lease = ctx.submit(prepared.request, "completions")
        lease.score_only = prepared.score_only
        request_id = new_id("cmpl")
        echo = echo_text(body, prepared.prompt_ids, ctx) if body.echo else ""
        logprobs = body.logprobs is not None
        scores = lease.handle.sequence.prompt_scores

        def echoed() -> CompletionLogprobs | None:  # once the first event came: the prompt is scored
            return echo_logprobs(prepared.prompt_ids, scores.entries(), text, echo) if scores is not None else None

        if body.stream:
            make = completion_chunk_maker(request_id, name, text, logprobs, echo, echoed)

            def usage_chunk(last: TokenEvent | None) -> BaseModel:
                return CompletionResponse(id=request_id, model=name, choices=[], usage=usage_of(last, lease.cut))

            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def progress_chunk(progress: dict[str, int]) -> str:
                return sse({"id": request_id, "object": "text_completion", "model": name, "choices": [],
                            "prompt_progress": progress})

            chunks = stream(lease, make, None, usage_chunk if include_usage else None)
            return ctx.event_stream(chunks, lease, progress_chunk if body.return_progress else None)
        result = await collect_unless_gone(lease, request)
        response = completion_response(request_id, name, result, text, logprobs, echo, echoed())
        return JSONResponse(response.model_dump(), headers=lease.headers)

    return router


def echo_text(body: CompletionRequest, ids: list[int], ctx: ServerContext) -> str:
    """The prompt as text, for ``echo``."""
    if isinstance(body.prompt, str):
        return body.prompt
    if body.prompt and isinstance(body.prompt[0], str):
        return str(body.prompt[0])
    return ctx.served.tokenizer.decode(ids)
