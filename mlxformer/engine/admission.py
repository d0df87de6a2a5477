"""The engine's admission half: an admitted sequence gets its caches (a prefix-cache hit, or
new ones; a preempted one resumes from what it had), and each step is fitted into the KV budget
(prefix entries evicted, then the latest sequences preempted). A base of ``Engine``, which holds
the state named below."""

from __future__ import annotations

from mlxformer.cache import CacheSettings, make_cache
from mlxformer.engine.batch_runner import BatchRunner
from mlxformer.engine.memory import KVBudget, KVBudgetExceeded, MemoryPlanner, held
from mlxformer.engine.metrics import EngineMetrics
from mlxformer.engine.prefix_cache import PrefixCache
from mlxformer.engine.prefix_sharing import PrefixSharing
from mlxformer.engine.replay import Replays, resume_tokens
from mlxformer.engine.scheduler import Scheduler, Step
from mlxformer.engine.sequence import Sequence
from mlxformer.models.decoder import Model
from mlxformer.speculative import SpeculativeSettings


class Admission:
    """Caches for admitted sequences and the KV budget of each step (``Engine``'s state)."""

    model: Model
    cache_settings: CacheSettings
    speculative: SpeculativeSettings | None
    budget: KVBudget | None
    planner: MemoryPlanner
    scheduler: Scheduler
    runner: BatchRunner
    sharing: PrefixSharing
    prefix_cache: PrefixCache
    metrics: EngineMetrics
    replays: Replays

    def _fail(self, sequence: Sequence, error: BaseException) -> None:
        raise NotImplementedError

    def _fit(self, step: Step) -> Step:
        """``step``, or a smaller one after preemptions, whose KV fits the budget beside the prefix
        cache (evicted down to the room left)."""
        if self.budget is None:
            return step
        while (room := self.budget.limit - self.planner.step_need(self.scheduler, step, self.runner.batched)) < 0:
            victim = self.scheduler.latest_active()
            assert victim is not None
            if self.scheduler.active == 1:  # alone and still too big (submit's check prevents it)
                self._fail(victim, KVBudgetExceeded("the request outgrew the KV memory budget"))
            else:
                self._preempt(victim)
            step = self.scheduler.plan(skip=self.sharing.held)
        self.prefix_cache.evict_to(room)
        return step

    def _preempt(self, sequence: Sequence, keep_cache: bool = True) -> None:
        """Take ``sequence`` out of the batch to be recomputed when there is room again; its caches
        go to the prefix cache (kept while room allows) unless they cannot be trusted."""
        self.metrics.preemptions.inc()
        self.sharing.held[:] = [s for s in self.sharing.held if s is not sequence]
        self._unbatch(sequence)
        if keep_cache and held(sequence) > sequence.cached_tokens:  # it computed something worth keeping
            self.prefix_cache.insert(sequence.cache_tokens, sequence.cache)
        sequence.cache, sequence.processed = [], 0
        self.scheduler.preempt(sequence)

    def _unbatch(self, sequence: Sequence) -> None:
        """Give a sequence leaving the batch its own caches and all its generated tokens back."""
        self.replays.stop(sequence)
        self.runner.release(sequence)

    def _attach_cache(self, sequence: Sequence) -> None:
        """Give an admitted sequence its caches: a prefix-cache copy when one serves, else new.
        A preempted one looks up everything it had; what is missing it recomputes."""
        resumed = bool(sequence.generated)
        scoring = sequence.prompt_scores is not None and not resumed  # scores need every position
        hit = None if scoring else self.prefix_cache.lookup(
            resume_tokens(sequence, self.prefix_cache, self.scheduler.prefill_chunk) if resumed else sequence.prompt)
        sequence.cache, cached = hit if hit is not None else (make_cache(self.model, self.cache_settings), 0)
        sequence.processed = min(cached, len(sequence.prompt))
        if resumed:
            if cached >= len(sequence.prompt):
                self.scheduler.start_decoding(sequence)
                self.replays.start(sequence, cached - len(sequence.prompt))
            return
        sequence.cached_tokens = cached
        self.metrics.prompt_tokens.inc(len(sequence.prompt))
        self.metrics.prefix_hit_tokens.inc(cached)
        request = sequence.request
        if self.speculative is not None and request.speculate and request.constraint is None:
            sequence.speculate(self.speculative, self.cache_settings)

