"""Ollama's API under ``/api`` as a thin translator over the same engine and turn code as the
other APIs: ``/api/chat`` and ``/api/generate`` (request -> ``Turn`` or a raw prompt; reply
deltas -> NDJSON lines, or one object), the model routes over the ``ModelHost`` and the
Hugging Face cache (``/api/tags``, ``/api/ps``, ``/api/show``, ``/api/pull``, ``/api/delete``),
``/api/version``, and ``/api/embed``/``/api/embeddings`` answering 501. Errors are Ollama's
``{"error": "..."}`` (see ``app.api_shape``)."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timezone
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse

from mlxformer.engine import TokenEvent
from mlxformer.errors import MlxformerError
from mlxformer.server.context import ServerContext
from mlxformer.server.embeddings_api import add_ollama_embed_routes
from mlxformer.server.errors import APIError, bad_request
from mlxformer.server.hooks import constraint_for
from mlxformer.server.ollama_protocol import (
    OLLAMA_VERSION, ChatBody, GenerateBody, ModelBody, chat_messages, keep_alive_seconds, response_format,
    sampling_fields, thinking,
)
from mlxformer.server.registry import ModelHost, ModelRecord
from mlxformer.server.reply import ReplyParser, whole_reply
from mlxformer.server.sse import frames
from mlxformer.server.streaming import EventStream, collect_unless_gone
from mlxformer.server.tools import tool_plan
from mlxformer.server.translate import check_prompt_chars, engine_request
from mlxformer.server.turn import Prepared, Turn, prepare

PATH_PREFIX = "/api/"
NDJSON = "application/x-ndjson"


def is_ollama_path(path: str) -> bool:
    """Whether a request path is one of this API's (its errors are Ollama-shaped)."""
    return path.startswith(PATH_PREFIX)


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def line(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False) + "\n"


def details(record: ModelRecord) -> dict[str, Any]:
    """Ollama's ``details`` of a model."""
    return {"parent_model": "", "format": record.format, "family": record.family,
            "families": [record.family] if record.family else None, "parameter_size": "",
            "quantization_level": record.quant}


def tag_entry(record: ModelRecord) -> dict[str, Any]:
    return {"name": record.name, "model": record.name, "modified_at": now(), "size": record.size,
            "digest": "", "details": details(record)}


def calls_of(parser: ReplyParser) -> list[dict[str, Any]]:
    """The reply's tool calls as Ollama's (arguments as objects)."""
    out = []
    for call in parser.calls:
        try:
            arguments = json.loads(call.arguments) if call.arguments.strip() else {}
        except json.JSONDecodeError:
            arguments = {}
        out.append({"function": {"name": call.name, "arguments": arguments if isinstance(arguments, dict) else {}}})
    return out


class Timing:
    """Ollama's durations (nanoseconds) of one request."""

    def __init__(self, load_ns: int) -> None:
        self.start, self.load_ns = time.monotonic_ns(), load_ns
        self.first: int | None = None

    def stats(self, event: TokenEvent | None) -> dict[str, Any]:
        end = time.monotonic_ns()
        first = self.first or end
        return {"total_duration": end - self.start + self.load_ns, "load_duration": self.load_ns,
                "prompt_eval_count": event.prompt_tokens if event else 0, "prompt_eval_duration": first - self.start,
                "eval_count": event.completion_tokens if event else 0, "eval_duration": end - first}


async def reply(
    ctx: ServerContext, host: ModelHost, name: str, prepared: Prepared, stream: bool, keep_alive: float | None,
    request: Request, timing: Timing, shape: Callable[[str, str, list[dict[str, Any]]], dict[str, Any]],
) -> Response:
    """Run ``prepared`` and answer as NDJSON lines or one object; ``shape(content, thinking,
    calls)`` is the API's part of a chunk (``message`` for chat, ``response`` for generate)."""
    lease = ctx.submit(prepared.request)
    parser = prepared.parser()
    head = {"model": name}

    def final(event: TokenEvent | None) -> dict[str, Any]:
        reason = "length" if event is not None and event.truncated else "stop"
        return {**head, "created_at": now(), "done": True, "done_reason": reason, **timing.stats(event)}

    if stream:
        def on_event(event: TokenEvent) -> list[str]:
            timing.first = timing.first or time.monotonic_ns()
            delta = parser.feed(event)
            out = []
            if delta.content or delta.reasoning:
                out.append(line({**head, "created_at": now(), **shape(delta.content, delta.reasoning, []),
                                 "done": False}))
            if event.finish_reason is not None:
                if parser.calls:
                    out.append(line({**head, "created_at": now(), **shape("", "", calls_of(parser)), "done": False}))
                out.append(line({**final(event), **shape("", "", [])}))
            return out

        async def lines() -> AsyncIterator[str]:
            try:
                async for chunk in frames(lease, on_event, lambda message: [line({"error": message})]):
                    yield chunk
            finally:
                host.finished(name, keep_alive)

        response = EventStream(lines(), lease)
        response.headers["content-type"] = NDJSON
        return response
    try:
        result = await collect_unless_gone(lease, request)
    finally:
        host.finished(name, keep_alive)
    timing.first = result.first_ns
    whole = whole_reply(parser, result.events)
    return JSONResponse({**final(result.last), **shape(whole.content, whole.reasoning, calls_of(parser))},
                        headers=lease.headers)


def chat_shape(content: str, reasoning: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["thinking"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return {"message": message}


def generate_shape(content: str, reasoning: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    return {"response": content, **({"thinking": reasoning} if reasoning else {})}


def reasons(ctx: ServerContext) -> bool:
    """Whether the served model reasons (Ollama's "thinking" capability)."""
    return bool(ctx.traits and ctx.traits.reasons)


def turn_thinking(ctx: ServerContext, model: str, think: bool | str | None) -> tuple[bool | None, int | None]:
    """``think`` as the turn's reasoning switch and budget; asking a model that does not reason
    to think is Ollama's 400."""
    switch, budget = thinking(think)
    if switch and not reasons(ctx):
        raise bad_request(f"{json.dumps(model)} does not support thinking", param="think")
    return switch, budget


async def loaded(host: ModelHost, name: str) -> tuple[ServerContext, Timing]:
    """The context of ``name`` (loading it if needed) and the request's timing."""
    start = time.monotonic_ns()
    ctx = await host.context(name)
    return ctx, Timing(time.monotonic_ns() - start)


def ollama_router(host: ModelHost) -> APIRouter:
    """The ``/api`` routes over ``host``."""
    router = APIRouter()

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": OLLAMA_VERSION}

    @router.get("/tags")
    async def tags() -> dict[str, Any]:
        return {"models": [tag_entry(r) for r in host.records()]}

    @router.get("/ps")
    async def ps() -> dict[str, Any]:
        models = []
        for r in host.records():
            if r.loaded:
                expires = datetime.fromtimestamp(r.expires_at, timezone.utc) if r.expires_at else None
                models.append({**tag_entry(r), "expires_at": (expires or datetime(9999, 1, 1, tzinfo=timezone.utc))
                               .isoformat().replace("+00:00", "Z"), "size_vram": 0,
                               "context_length": r.context_length})
        return {"models": models}

    @router.post("/show")
    async def show(body: ModelBody) -> dict[str, Any]:
        ctx = await host.context(body.model_name())
        record = next((r for r in host.records() if r.name == ctx.served.name), None)
        args = ctx.engine.model.args
        capabilities = (["completion"] if args.head == "lm" else ["embedding"]) + (
            ["tools"] if ctx.served.tokenizer.chat_template else []) + (
            ["thinking"] if reasons(ctx) else [])
        info = {"general.architecture": args.model_type, f"{args.model_type}.context_length": ctx.served.context_length,
                f"{args.model_type}.block_count": args.num_hidden_layers,
                f"{args.model_type}.embedding_length": args.hidden_size}
        defaults = ctx.served.tokenizer.sampling_defaults.as_dict()
        names = {"temp": "temperature", "repetition_penalty": "repeat_penalty"}
        parameters = "\n".join(f"{names.get(k, k):<16}{v}" for k, v in defaults.items())
        return {"modelfile": "", "parameters": parameters, "template": ctx.served.tokenizer.chat_template or "",
                "details": details(record) if record else {}, "model_info": info, "capabilities": capabilities,
                "modified_at": now()}

    @router.post("/chat")
    async def chat(body: ChatBody, request: Request) -> Response:
        ctx, timing = await loaded(host, body.model)
        keep_alive = keep_alive_seconds(body.keep_alive)
        fields, predict = sampling_fields(body.model, body.options)
        if not body.messages:  # Ollama: an empty chat loads (or, with keep_alive 0, unloads) the model
            host.finished(body.model, keep_alive)
            return JSONResponse({"model": body.model, "created_at": now(), **chat_shape("", "", []), "done": True,
                                 "done_reason": "unload" if keep_alive == 0 else "load"})
        think, budget = turn_thinking(ctx, body.model, body.think)
        turn = Turn(messages=chat_messages(body.messages), fields=fields, max_tokens=predict, tools=body.tools or None,
                    response_format=response_format(body.format), thinking=think, reasoning_budget=budget,
                    max_tokens_param="options.num_predict", plain_route="/api/generate")
        prepared = await ctx.prepare(lambda: prepare(turn, ctx.served, ctx.traits))
        return await reply(ctx, host, body.model, prepared, body.stream, keep_alive, request, timing, chat_shape)

    @router.post("/generate")
    async def generate(body: GenerateBody, request: Request) -> Response:
        ctx, timing = await loaded(host, body.model)
        keep_alive = keep_alive_seconds(body.keep_alive)
        fields, predict = sampling_fields(body.model, body.options)
        if body.images:
            raise bad_request("images are not supported: this server serves a text model", param="images")
        if body.suffix:
            raise bad_request("suffix (fill-in-the-middle) is not supported", param="suffix")
        if not body.prompt:  # Ollama: an empty prompt loads (or unloads) the model
            host.finished(body.model, keep_alive)
            return JSONResponse({"model": body.model, "created_at": now(), "response": "", "done": True,
                                 "done_reason": "unload" if keep_alive == 0 else "load"})
        think, budget = turn_thinking(ctx, body.model, body.think)
        prompt, served = body.prompt, ctx.served
        if body.raw or not served.tokenizer.chat_template:
            def raw() -> Prepared:
                check_prompt_chars(len(prompt), served, "prompt")
                format_ = response_format(body.format)
                request_ = engine_request(fields, served.tokenizer.encode(prompt), served, max_tokens=predict,
                                          logprobs=None, constraint=constraint_for(format_, served.tokenizer,
                                                                                   served.vocab_size),
                                          prompt_param="prompt", max_tokens_param="options.num_predict")
                return Prepared(request_, tool_plan(None, None), ctx.traits, False)

            prepared = await ctx.prepare(raw)
        else:
            messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
                {"role": "user", "content": prompt}]
            turn = Turn(messages=messages, fields=fields, max_tokens=predict, response_format=response_format(body.format),
                        thinking=think, reasoning_budget=budget, prompt_param="prompt",
                        max_tokens_param="options.num_predict")
            prepared = await ctx.prepare(lambda: prepare(turn, served, ctx.traits))
        return await reply(ctx, host, body.model, prepared, body.stream, keep_alive, request, timing, generate_shape)

    @router.post("/pull")
    async def pull(body: ModelBody) -> Response:
        from mlxformer.formats.hub import fetch, is_repo_ref

        name = body.model_name()
        if not is_repo_ref(name):
            raise bad_request(f"{name!r} is not a Hugging Face repo id (OWNER/NAME[:QUANT])", param="model")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

        def progress(file: str, size: int, done: bool) -> None:
            status = {"status": f"pulling {file}", "digest": file, "total": size, "completed": size if done else 0}
            loop.call_soon_threadsafe(queue.put_nowait, status)

        async def work() -> None:
            try:
                await loop.run_in_executor(None, lambda: fetch(name, progress))
                host.add(name)  # a several-models server serves it from now on
                for status in ("verifying sha256 digest", "writing manifest", "success"):
                    await queue.put({"status": status})
            except MlxformerError as exc:
                await queue.put({"error": str(exc)})
            await queue.put(None)

        task = asyncio.ensure_future(work())
        if not body.stream:
            await task
            statuses = [item for item in iter(queue.get_nowait, None)]
            if "error" in statuses[-1]:
                raise APIError(statuses[-1]["error"], 404 if "no such hub repo" in statuses[-1]["error"] else 500)
            return JSONResponse({"status": "success"})

        async def lines() -> AsyncIterator[str]:
            yield line({"status": "pulling manifest"})
            while (item := await queue.get()) is not None:
                yield line(item)

        return StreamingResponse(lines(), media_type=NDJSON)

    @router.delete("/delete")
    async def delete(body: ModelBody) -> Response:
        from mlxformer.formats.hub_cache import find_cached, remove

        name = body.model_name()
        try:
            models = find_cached(name)
        except MlxformerError as exc:
            raise APIError(f"model {name!r} not found ({exc})", 404, "not_found_error", "model") from exc
        host.unload(name)
        remove(models)
        return Response(status_code=200)

    add_ollama_embed_routes(router, host)
    return router

