"""Model metadata and template tools: the ``/v1/models`` entry (context length and
capabilities), ``GET /v1/models/{id}``, and llama-server's ``POST /tokenize``, ``/detokenize``,
``/apply-template`` and ``GET /lora-adapters``."""

from __future__ import annotations

from typing import Any, Optional

from fastapi import APIRouter
from pydantic import Field

from mlxformer.errors import MlxformerError
from mlxformer.server.errors import APIError, bad_request
from mlxformer.server.context import ServerContext
from mlxformer.server.openapi import BODY, error_responses
from mlxformer.server.protocol import ChatMessage, Lenient, ModelCard
from mlxformer.server.turn import Turn, render_prompt
from mlxformer.server.tools import tool_plan

MAX_DETOKENIZE = 1 << 20


class TokenizeRequest(Lenient):
    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(Lenient):
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE)


class ApplyTemplateRequest(Lenient):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Optional[list[dict[str, Any]]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


def model_card(ctx: ServerContext) -> ModelCard:
    """The served model's ``/v1/models`` entry: context length and capabilities."""
    assert ctx.traits is not None
    return ModelCard(id=ctx.served.name, context_length=ctx.served.context_length,
                     capabilities=ctx.traits.capabilities(ctx.served))


def anthropic_models(ctx: ServerContext) -> dict[str, Any]:
    """``GET /v1/models`` in the Anthropic API's shape (asked with an ``anthropic-version`` header)."""
    name = ctx.served.name
    entry = {"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z"}
    return {"data": [entry], "has_more": False, "first_id": name, "last_id": name}


def models_router(ctx: ServerContext) -> APIRouter:
    """``/models/{id}`` (under ``/v1``; the list is in ``openai_routes``)."""
    router = APIRouter()
    served = ctx.served

    @router.get("/models/{model_id:path}", responses=error_responses([404]))
    async def model(model_id: str) -> ModelCard:
        if served.base_name(model_id) != served.name:
            raise APIError(f"the model {model_id!r} does not exist; this server serves {served.name!r}",
                           404, "invalid_request_error", "model", "model_not_found")
        return model_card(ctx)

    return router


def template_router(ctx: ServerContext) -> APIRouter:
    """``/tokenize``, ``/detokenize`` and ``/apply-template`` (llama-server's shapes)."""
    router = APIRouter()
    served = ctx.served
    tokenizer = served.tokenizer

    @router.get("/lora-adapters")
    async def lora_adapters() -> list[dict[str, Any]]:
        """llama-server's list of the adapters requests choose from (``lora: [{id, scale}]``,
        or model ``BASE:NAME``); a request without them runs the base model (scale 0)."""
        bank = served.adapters
        if bank is None:
            return []
        return [{"id": i, "name": name, "path": path, "type": kind, "scale": 0.0}
                for i, (name, path, kind) in enumerate(zip(bank.names, bank.paths, bank.kinds))]

    @router.post("/tokenize", responses=error_responses(BODY))
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        def work() -> dict[str, Any]:
            ids = tokenizer.encode(body.content, add_special_tokens=body.add_special)
            if body.with_pieces:
                return {"tokens": [{"id": i, "piece": tokenizer.decode([i])} for i in ids]}
            return {"tokens": ids}

        return await ctx.prepare(work)  # a large body must not stall other requests' streams

    @router.post("/detokenize", responses=error_responses(BODY))
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        def work() -> dict[str, str]:
            vocab = min(tokenizer.vocab_size, served.vocab_size)
            if bad := [i for i in body.tokens if not 0 <= i < vocab]:
                raise bad_request(f"token id {bad[0]} is outside the vocabulary (size {vocab})", param="tokens")
            try:
                return {"content": tokenizer.decode(body.tokens)}
            except MlxformerError as exc:
                raise bad_request(str(exc), param="tokens") from exc

        return await ctx.prepare(work)

    @router.post("/apply-template", responses=error_responses(BODY))
    async def apply_template(body: ApplyTemplateRequest) -> dict[str, str]:
        kwargs = dict(body.chat_template_kwargs or {})
        thinking = kwargs.pop("enable_thinking", None)
        turn = Turn(messages=[m.template_dict() for m in body.messages], fields=None,  # type: ignore[arg-type]
                    tools=body.tools, template_kwargs=kwargs, thinking=None if thinking is None else bool(thinking))
        return {"prompt": await ctx.prepare(lambda: render_prompt(turn, served, tool_plan(body.tools, None), ctx.traits))}

    return router
