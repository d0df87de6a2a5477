"""What every part of an engine step works with (``EngineParts``): the model, the scheduler's
queues, the pool runner, the KV planner and budget, the prefix cache and its sharing between
running prompts, the replays of preempted sequences, the metrics and the live requests' handles."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxformer.engine.batch_runner import BatchRunner
from mlxformer.engine.handle import RequestHandle
from mlxformer.engine.memory import KVBudget, MemoryPlanner, nbytes
from mlxformer.engine.metrics import EngineMetrics
from mlxformer.engine.prefix_cache import PrefixCache
from mlxformer.engine.prefix_sharing import PrefixSharing
from mlxformer.engine.replay import Replays
from mlxformer.engine.request_state import RequestState
from mlxformer.engine.scheduler import Scheduler
from mlxformer.models.decoder import Model


@dataclass
class EngineParts:
    """The engine's shared objects, one of each; the engine's collaborators (``Admission``,
    ``DecodeStep``, ``Delivery``, ``Departures``) each hold this and nothing else in common."""

    model: Model
    scheduler: Scheduler
    runner: BatchRunner
    planner: MemoryPlanner
    budget: KVBudget | None
    prefix_cache: PrefixCache
    sharing: PrefixSharing
    replays: Replays
    metrics: EngineMetrics
    handles: dict[int, RequestHandle] = field(default_factory=dict)  # id(sequence) -> its caller's handle

    def active(self) -> list[RequestState]:
        """The sequences holding a batch slot (prefilling, then running)."""
        with self.scheduler.lock:
            return self.scheduler.active

    def kv_bytes(self) -> int:
        """KV bytes held now: every active sequence's share of its pool, and the prefix cache."""
        return sum(nbytes(s) for s in self.active()) + self.prefix_cache.nbytes
