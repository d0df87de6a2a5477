"""Embeddings and rerank over HTTP: OpenAI's ``POST /v1/embeddings``, the llama-server / Jina /
Cohere ``POST /v1/rerank`` and Ollama's ``POST /api/embed`` (and the older ``/api/embeddings``).
Inputs are tokenized on the context's pool; the forwards run on the engine's thread, one job
(``Engine.run_job``) per padded batch of at most the engine's step tokens, keeping no cache."""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any, Callable, Literal, Optional, Sequence, TypeVar, Union

import numpy as np
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from mlxformer.embeddings.encode import batches, embed_tokens, encode_inputs, shorten
from mlxformer.embeddings.rerank import rerank_inputs, rerank_tokens, scorer
from mlxformer.engine import EngineNotRunning
from mlxformer.errors import MlxformerError
from mlxformer.server.context import ServerContext
from mlxformer.server.errors import APIError, bad_request
from mlxformer.server.ollama_protocol import keep_alive_seconds
from mlxformer.server.openapi import GENERATION, error_responses
from mlxformer.server.protocol import Lenient
from mlxformer.server.registry import ModelHost

__all__ = ["embeddings_router", "add_ollama_embed_routes"]

T = TypeVar("T")
MAX_INPUTS = 2048  # OpenAI's limit of inputs per request


class EmbeddingRequest(Lenient):
    input: Union[str, list[str], list[int], list[list[int]]]
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(default=None, ge=1)
    user: Optional[str] = None
    prompt_name: Optional[str] = None  # a prompt of the model's ("query", "document"; sentence-transformers')


class RerankDocument(Lenient):
    text: str


class RerankRequest(Lenient):
    query: str
    documents: list[Union[str, RerankDocument]]
    model: Optional[str] = None
    top_n: Optional[int] = Field(default=None, ge=1)
    return_documents: bool = True
    instruction: Optional[str] = None  # the reranker's task (Qwen3-Reranker's "<Instruct>")


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]  # floats, or base64 of little-endian float32


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: Optional[RerankDocument] = None


class RerankResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str
    results: list[RerankResult]
    usage: Usage


class OllamaEmbedBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    input: Union[str, list[str], None] = None
    prompt: Optional[str] = None  # /api/embeddings
    truncate: bool = True
    dimensions: Optional[int] = Field(default=None, ge=1)
    keep_alive: Union[float, str, None] = None


async def run_on_engine(ctx: ServerContext, work: Callable[[], T]) -> T:
    """``work`` as a job on the engine's thread (503 when the engine is not running, 400 for bad input)."""
    try:
        return await asyncio.wrap_future(ctx.engine.run_job(work))
    except EngineNotRunning as exc:
        raise APIError(str(exc), 503, "server_error", None, "engine_not_running") from exc
    except MlxformerError as exc:
        raise bad_request(str(exc)) from exc


async def batch_jobs(ctx: ServerContext, ids: list[list[int]], work: Callable[[list[list[int]], int], Any]
                     ) -> np.ndarray:
    """``work(inputs, budget)`` (rows out in the inputs' order) over ``ids`` as one engine job
    per padded batch (``batches``, the engine's step tokens each): decode steps run between
    them, so a large request does not hold the model for its whole length."""
    budget = ctx.engine.scheduler.step_tokens
    out: list[Any] = [None] * len(ids)
    for group in batches([len(row) for row in ids], budget):
        rows = await run_on_engine(ctx, lambda group=group: work([ids[i] for i in group], budget))
        for index, row in zip(group, rows):
            out[index] = row
    return np.array(out)


def token_inputs(ctx: ServerContext, given: Sequence[str] | Sequence[Sequence[int]], prompt_name: str | None,
                 truncate: bool, param: str = "input") -> list[list[int]]:
    """The token ids of each input (texts after the model's prompt ``prompt_name``, or ids as
    given), each checked against the vocabulary and the context (cut to it when ``truncate``)."""
    if not given:
        raise bad_request("the input must not be empty", param)
    if len(given) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} inputs per request, got {len(given)}", param)
    served, head = ctx.served, ctx.engine.model.embedding_head
    if isinstance(given[0], str):
        if any(not text for text in given):
            raise bad_request("an input is an empty string", param)
        try:
            ids = encode_inputs(served.tokenizer, given, head.prefix(prompt_name))  # type: ignore[arg-type]
        except MlxformerError as exc:
            raise bad_request(str(exc), "prompt_name") from exc
    else:
        ids = [list(row) for row in given]  # type: ignore[arg-type]
        if any(not row for row in ids):
            raise bad_request("an input is an empty list of tokens", param)
        if any(not 0 <= t < served.vocab_size for row in ids for t in row):
            raise bad_request(f"token ids must be in [0, {served.vocab_size})", param)
    limit = served.context_length
    for row in ids:
        if len(row) > limit and not truncate:
            raise bad_request(f"this model's maximum context length is {limit} tokens; an input has {len(row)}",
                              param, "context_length_exceeded")
    return [row[:limit] for row in ids]


async def embed_vectors(ctx: ServerContext, given: Sequence[Any], prompt_name: str | None, dimensions: int | None,
                        truncate: bool) -> tuple[np.ndarray, int]:
    """The embeddings of ``given`` (texts or token-id lists) and their token count."""
    ids = await ctx.prepare(lambda: token_inputs(ctx, given, prompt_name, truncate))
    model = ctx.engine.model
    vectors = await batch_jobs(ctx, ids, lambda rows, budget: embed_tokens(model, rows, budget=budget))
    if dimensions is not None and dimensions > vectors.shape[-1]:
        raise bad_request(f"dimensions must be at most {vectors.shape[-1]} for this model", "dimensions")
    return shorten(vectors, dimensions, model.embedding_head.normalize), sum(len(row) for row in ids)


def openai_inputs(given: Union[str, list[str], list[int], list[list[int]]]) -> list[Any]:
    """OpenAI's ``input``: one string, strings, one token-id list or token-id lists, as a list of inputs."""
    if isinstance(given, str):
        return [given]
    if given and isinstance(given[0], int):
        return [given]
    return list(given)


def embeddings_router(ctx: ServerContext) -> APIRouter:
    """``POST /embeddings`` and ``POST /rerank`` (mounted under ``/v1``)."""
    router = APIRouter()

    @router.post("/embeddings", response_model=EmbeddingResponse, response_model_exclude_none=True,
                 responses=error_responses(GENERATION))
    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        vectors, tokens = await embed_vectors(ctx, openai_inputs(body.input), body.prompt_name, body.dimensions, False)
        encode: Callable[[np.ndarray], Any] = (
            (lambda v: base64.b64encode(v.astype("<f4").tobytes()).decode()) if body.encoding_format == "base64"
            else (lambda v: v.tolist()))
        data = [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": ctx.served.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @router.post("/rerank", response_model=RerankResponse, response_model_exclude_none=True,
                 responses=error_responses(GENERATION))
    async def rerank_route(body: RerankRequest) -> dict[str, Any]:
        texts = [d if isinstance(d, str) else d.text for d in body.documents]
        if not texts:
            raise bad_request("documents must not be empty", "documents")
        served, model = ctx.served, ctx.engine.model
        try:
            scorer(model, served.tokenizer)  # the model can score
        except MlxformerError as exc:
            raise bad_request(str(exc), "model") from exc
        ids = await ctx.prepare(lambda: rerank_inputs(served.tokenizer, body.query, texts, body.instruction))
        token_inputs(ctx, ids, None, False, "documents")  # the context and count checks
        scores = await batch_jobs(ctx, ids, lambda rows, budget: rerank_tokens(model, served.tokenizer, rows, budget))
        order = sorted(range(len(texts)), key=lambda i: -scores[i])[:body.top_n]
        results = [{"index": i, "relevance_score": float(scores[i]),
                    **({"document": {"text": texts[i]}} if body.return_documents else {})} for i in order]
        tokens = sum(len(row) for row in ids)
        return {"object": "list", "model": served.name, "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return router


def add_ollama_embed_routes(router: APIRouter, host: ModelHost) -> None:
    """Ollama's ``POST /embed`` (inputs -> ``embeddings``) and ``POST /embeddings`` (one
    ``prompt`` -> ``embedding``) on ``router`` (mounted under ``/api``)."""

    async def vectors_of(body: OllamaEmbedBody, given: list[str]) -> tuple[np.ndarray, int, int]:
        start = time.monotonic_ns()
        ctx = await host.context(body.model)
        loaded = time.monotonic_ns() - start
        try:
            vectors, tokens = await embed_vectors(ctx, given, None, body.dimensions, body.truncate)
        finally:
            host.finished(body.model, keep_alive_seconds(body.keep_alive))
        return vectors, tokens, loaded

    @router.post("/embed")
    async def embed(body: OllamaEmbedBody) -> dict[str, Any]:
        start = time.monotonic_ns()
        given = [body.input] if isinstance(body.input, str) else list(body.input or [])
        vectors, tokens, loaded = await vectors_of(body, given)
        return {"model": body.model, "embeddings": vectors.tolist(), "total_duration": time.monotonic_ns() - start,
                "load_duration": loaded, "prompt_eval_count": tokens}

    @router.post("/embeddings")
    async def embeddings(body: OllamaEmbedBody) -> dict[str, Any]:
        if not body.prompt:
            raise bad_request("prompt is required", "prompt")
        vectors, _, _ = await vectors_of(body, [body.prompt])
        return {"embedding": vectors[0].tolist()}
