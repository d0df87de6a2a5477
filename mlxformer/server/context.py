"""What every API router shares: the engine and the served model, the thread pool that
prepares requests off the event loop, and submission with the HTTP mapping of engine refusals."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional, TypeVar

from mlxformer.engine import Engine, EngineNotRunning, EngineOverloaded, GenerationRequest, TokenEvent
from mlxformer.errors import MlxformerError
from mlxformer.server.errors import APIError
from mlxformer.server.chat_output import TokenStrings
from mlxformer.server.sse import PING, SSE_PING_SECONDS, keepalive, prompt_progress
from mlxformer.server.streaming import EventStream, InFlight, Lease
from mlxformer.server.translate import ServedModel
from mlxformer.server.turn import Traits

T = TypeVar("T")
PREPARE_THREADS = 2  # templating, tokenization and grammar compilation run on at most this many threads
RETRY_AFTER_SECONDS = 1


@dataclass
class ServerContext:
    """The state one app's routers share (``create_app`` makes it; routers take it as an argument)."""

    engine: Engine
    served: ServedModel
    text: TokenStrings
    inflight: InFlight = field(default_factory=InFlight)
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="mlxformer-prepare")
    )
    traits: Optional[Traits] = None  # the model's call format and reasoning (default: read from its template)
    any_model_name: bool = True  # every route serves any model name it is sent (registry.check_model)
    sse_ping_seconds: float | None = SSE_PING_SECONDS  # keep-alive comments after this long without data
    strict_max_tokens: bool = False  # Messages: refuse a max_tokens beyond the context instead of clamping it

    def event_stream(
        self, chunks: AsyncIterator[str], lease: Lease, progress: Callable[[dict[str, int]], str] | None = None,
        ping: str = PING,
    ) -> EventStream:
        """The SSE response of every streaming route: ``chunks`` with keep-alive comments while
        none comes (a long prefill) and, when ``progress`` is given (the request asked for
        ``return_progress``), the prompt's progress as the events it makes (``server/sse.py``)."""
        poll = prompt_progress(lease.handle, progress) if progress is not None else None
        return EventStream(keepalive(chunks, self.sse_ping_seconds, poll, ping), lease)

    def __post_init__(self) -> None:
        if self.traits is None:
            self.traits = Traits.of(self.served)

    async def prepare(self, work: Callable[[], T]) -> T:
        """Run ``work`` (CPU-bound request preparation) on the bounded pool, not on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, work)

    def submit(self, request: GenerationRequest, api: str = "chat", asked: int | None = None) -> Lease:
        """Queue ``request`` (for ``api``: its prompt tokens are counted as cached or prefilled,
        ``mlxformer_api_prompt_tokens`` in ``/metrics``): 429 with ``Retry-After`` when the engine's queue is full, 503 when it
        is not running, 400 when it refuses the request (its KV cache can never fit, for one).
        ``asked``: the max tokens the client asked for (default: the request's), which the lease
        reports as cut when the engine runs fewer (``Lease.cut``)."""
        try:
            handle = self.engine.submit(request)
        except EngineOverloaded as exc:
            raise APIError(
                f"the server is busy ({exc}); retry later", 429, "rate_limit_error", None, "queue_full",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            ) from exc
        except EngineNotRunning as exc:
            raise APIError(str(exc), 503, "server_error", None, "engine_not_running") from exc
        except MlxformerError as exc:
            raise APIError(str(exc), 400) from exc
        prompt_tokens = self.engine.metrics.counter(
            "mlxformer_api_prompt_tokens", "Prompt tokens of finished requests by API, from the prompt cache or prefilled",
            ("api", "source"))

        def count(event: TokenEvent) -> None:
            prompt_tokens.labels(api, "cached").inc(event.cached_tokens)
            prompt_tokens.labels(api, "prefilled").inc(event.prompt_tokens - event.cached_tokens)

        return Lease(handle, self.inflight, request.max_tokens if asked is None else asked, count)
