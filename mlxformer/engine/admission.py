"""The engine's admission (``Admission``): an admitted sequence gets its row of a pool with a
prefix-cache hit's tokens or none (a preempted one resumes from what it had), each step is fitted
into the KV budget (prefix entries evicted, then the latest sequences preempted) and its rows
widened one layer at a time, and MLX's buffer cache is emptied after a step that freed KV."""

from __future__ import annotations

import mlx.core as mx

from mlxformer.cache import CacheSettings, make_cache, new_held
from mlxformer.engine.delivery import Delivery
from mlxformer.engine.departures import Departures
from mlxformer.engine.memory import KVBudgetExceeded
from mlxformer.engine.parts import EngineParts
from mlxformer.engine.replay import resume_tokens
from mlxformer.engine.request_state import RequestState
from mlxformer.engine.scheduler import Step
from mlxformer.models.decoder import Model
from mlxformer.speculative.speculator import SpeculativeSettings


class Admission:
    """Rows for admitted sequences and the KV budget of each step."""

    def __init__(self, parts: EngineParts, departures: Departures, delivery: Delivery,
                 cache_settings: CacheSettings, speculative: SpeculativeSettings | None) -> None:
        self.parts, self.departures, self.delivery = parts, departures, delivery
        self.cache_settings, self.speculative = cache_settings, speculative
        self._freed_last_step = False  # whether the last step freed KV buffers (``drop_freed``)

    def fit(self, step: Step) -> Step:
        """``step``, or a smaller one after preemptions, whose KV fits the budget beside the prefix
        cache (evicted down to the room left)."""
        parts = self.parts
        if parts.budget is None:
            return step
        scheduler = parts.scheduler
        while (room := parts.budget.limit - parts.planner.step_need(scheduler, step)) < 0:
            victim = scheduler.latest_active()
            assert victim is not None
            if self.delivery.drain():  # tokens in flight are handed out first (one that ends frees its room)
                step = scheduler.plan(skip=parts.sharing.waiting)
                continue
            if len(scheduler.active) == 1:  # alone and still too big (submit's check prevents it)
                self.departures.fail(victim, KVBudgetExceeded("the request outgrew the KV memory budget"))
            else:
                self.departures.preempt(victim)
            step = scheduler.plan(skip=parts.sharing.waiting)
        parts.prefix_cache.evict_to(room)
        return step

    def widen(self, step: Step) -> None:
        """Under a KV budget, widen the pool rows that ``step``'s prompt chunks and speculation
        rounds will outgrow one layer at a time, each evaluated before the next
        (``KVPool.reserve``), as the decode steps widen a pool (``BatchRunner.staged``): one
        layer's buffers are held twice at most, not all of them."""
        if self.parts.budget is None:
            return
        fed = step.fed(self.parts.planner.draft_tokens)
        for sequence in [c.sequence for c in step.prefill] + step.decode:
            tokens = fed.pop(id(sequence), 0)
            if tokens and sequence.cache:
                self.parts.runner.reserve(sequence, tokens)

    def kv_fingerprint(self) -> tuple:
        """What changes when KV buffers are freed: the sequences decoding and prefilling, and the
        KV bytes held (nothing without a budget)."""
        parts = self.parts
        if parts.budget is None:
            return ()
        active = parts.active()
        return [id(s) for s in parts.scheduler.running], [id(s) for s in active], parts.kv_bytes()

    def drop_freed(self, before: tuple, prompted: bool = False) -> None:
        """Under a KV budget, empty MLX's buffer cache after a step that freed KV buffers (a
        growth, a seat or leave, a retire, an eviction, a sequence's last prompt chunk) or ran
        prompt chunks (``prompted``), and after the step that follows it. Buffers of those sizes
        seldom serve again: a chunk attends over a context one chunk longer than the last one's,
        so its scores never fit the cached ones (kept, they piled up while a second prompt
        prefilled beside a first's full KV: 18.2 MiB beside a 67.5 MiB budget, SmolLM2
        bfloat16), and they fill the cache that the next step's activations would reuse. The
        second clear drops the activations of that step, which are freed only once the next
        step has read its tokens (the overlap): kept, they sat in the cache through every decode
        step after the prompts (19.6 MiB beside a 59.7 MiB budget)."""
        freed = bool(before) and (prompted or self.kv_fingerprint() != before)
        if freed or self._freed_last_step:
            mx.clear_cache()
        self._freed_last_step = freed

    def seat(self, sequence: RequestState) -> None:
        """Give an admitted sequence its row: with a prefix-cache hit's tokens when one serves.
        A preempted one looks up everything it had; what is missing it recomputes. Under a KV
        budget the prefix cache first leaves room for its seat (``MemoryPlanner.seat_need``: the
        hit's blocks stay while they are copied into its row, one layer at a time)."""
        parts = self.parts
        scheduler, prefix_cache = parts.scheduler, parts.prefix_cache
        resumed = bool(sequence.generated)
        scoring = sequence.prompt_scores is not None and not resumed  # scores need every position
        hit = None if scoring else prefix_cache.lookup(
            resume_tokens(sequence, prefix_cache, scheduler.prefill_chunk) if resumed else sequence.prompt,
            sequence.cache_salt)
        # what its layers hold: the hit's tokens, or nothing yet (new caches)
        held, cached = hit if hit is not None else (new_held(parts.model, self.cache_settings), 0)
        sequence.processed = min(cached, len(sequence.prompt))
        if resumed:
            if cached >= len(sequence.prompt):
                scheduler.start_decoding(sequence)
                parts.replays.start(sequence, cached - len(sequence.prompt))
        else:
            sequence.cached_tokens = cached
            parts.metrics.prompt_tokens.inc(len(sequence.prompt))
            parts.metrics.prefix_hit_tokens.inc(cached)
            request = sequence.request
            if self.speculative is not None and request.speculate and request.constraint is None:
                sequence.speculate(self.speculative, self.cache_settings)
        if parts.budget is not None:  # room for the seat first
            prefix_cache.evict_to(parts.budget.limit - parts.planner.seat_need(scheduler, sequence, held))
        parts.runner.seat(sequence, held)  # its row of the pool from now on


def warm_up(model: Model, draft: Model | None, settings: CacheSettings) -> None:
    """Validate the cache settings in the caller's thread and run one token through the model(s)
    there: MLX arrays made lazily in a thread (weight views, for example) can only be evaluated
    by that thread, so the engine's thread must find them all evaluated."""
    for warm in (draft, model):
        if warm is not None:
            probe = make_cache(warm, settings)
            token = mx.array([[0]])  # a model without an LM head (embeddings only) runs its hidden states
            mx.eval(warm.last_logits(token, probe) if warm.args.head == "lm" else warm.hidden_states(token, probe))
