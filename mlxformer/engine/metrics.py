"""The engine's Prometheus metrics (``prometheus-client``), in a registry of its own per engine.

Others add theirs to ``EngineMetrics.registry`` (the server its requests by status); the
server's ``GET /metrics`` renders the registry in the Prometheus text format."""

from __future__ import annotations

import time
from typing import Callable

import mlx.core as mx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from mlxformer.engine.handle import RequestHandle
from mlxformer.engine.request_state import TokenEvent

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class EngineMetrics:
    """Counters, gauges and histograms of one engine (names prefixed ``mlxformer_``)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._extra: dict[str, Counter] = {}
        r = self.registry
        self.prompt_tokens = Counter("mlxformer_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("mlxformer_generated_tokens", "Tokens generated", registry=r)
        self.prefix_hit_tokens = Counter("mlxformer_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", registry=r)
        self.prefix_hit_ratio = Gauge("mlxformer_prefix_cache_hit_ratio", "Prompt tokens served from the prefix cache over all admitted prompt tokens", registry=r)
        self.prefix_hit_ratio.set_function(lambda: _ratio(self.prefix_hit_tokens, self.prompt_tokens))
        self.prefilled_tokens = Counter("mlxformer_prefilled_tokens", "Prompt tokens run through the model (not served by the prompt cache)", registry=r)
        self.preemptions = Counter("mlxformer_preemptions", "Sequences preempted to keep KV memory within the budget", registry=r)
        self.finished = Counter("mlxformer_engine_requests", "Requests the engine ended, by finish reason", ["reason"], registry=r)
        self.ttft = Histogram("mlxformer_time_to_first_token_seconds", "From submit to the first token", buckets=TTFT_BUCKETS, registry=r)
        self.token_latency = Histogram("mlxformer_inter_token_latency_seconds", "Between a request's tokens", buckets=TOKEN_BUCKETS, registry=r)
        self.queue_depth = Gauge("mlxformer_queue_depth", "Requests waiting for a batch slot", registry=r)
        self.running = Gauge("mlxformer_running_sequences", "Sequences holding a batch slot", registry=r)
        self.kv_used = Gauge("mlxformer_kv_bytes_used", "KV cache bytes held by sequences and the prefix cache", registry=r)
        self.kv_budget = Gauge("mlxformer_kv_bytes_budget", "The KV memory budget in bytes (0: none)", registry=r)
        self.mlx_active = Gauge("mlxformer_mlx_active_bytes", "Bytes in MLX's live arrays (weights, KV, activations)", registry=r)
        self.mlx_cache = Gauge("mlxformer_mlx_cache_bytes", "Bytes MLX keeps in freed buffers for reuse", registry=r)
        self.step_reserve = Gauge("mlxformer_step_reserve_bytes", "A step's activations allowed beside the KV budget, "
                                  "also MLX's buffer cache limit (0: no budget)", registry=r)

    def counter(self, name: str, documentation: str, labels: tuple[str, ...] = ()) -> Counter:
        """A counter in this registry, made on first use (so that two apps over one engine share it)."""
        if name not in self._extra:
            self._extra[name] = Counter(name, documentation, list(labels), registry=self.registry)
        return self._extra[name]

    def watch(self, queue: Callable[[], float], running: Callable[[], float], kv_used: Callable[[], float], budget: int) -> None:
        """Read the gauges from the engine at each scrape."""
        self.queue_depth.set_function(queue)
        self.running.set_function(running)
        self.kv_used.set_function(kv_used)
        self.kv_budget.set(budget)
        self.mlx_active.set_function(mx.get_active_memory)
        self.mlx_cache.set_function(mx.get_cache_memory)

    def event(self, handle: RequestHandle, event: TokenEvent) -> None:
        """Record one event put to ``handle`` (on the engine thread)."""
        now = time.monotonic()
        if event.token is not None:
            self.generated_tokens.inc()
            if handle.last_event_at is None:
                self.ttft.observe(now - handle.submitted_at)
            else:
                self.token_latency.observe(now - handle.last_event_at)
            handle.last_event_at = now
        if event.finish_reason is not None:
            self.finished.labels(event.finish_reason).inc()


def _ratio(part: Counter, whole: Counter) -> float:
    """``part / whole`` of two counters' totals (0 while ``whole`` is 0)."""
    total = lambda counter: next(s.value for s in counter.collect()[0].samples if s.name.endswith("_total"))  # noqa: E731
    return total(part) / total(whole) if total(whole) else 0.0
