"""The engine's admission half: an admitted sequence gets its caches (a prefix-cache hit, or
new ones; a preempted one resumes from what it had), and each step is fitted into the KV budget
(prefix entries evicted, then the latest sequences preempted). A base of ``Engine``, which holds
the state named below."""

from __future__ import annotations

import math

import mlx.core as mx

from mlxformer.cache import CacheSettings, make_cache
from mlxformer.engine.batch_runner import BatchRunner
from mlxformer.engine.memory import BLOCK, KVBudget, KVBudgetExceeded, MemoryPlanner, held, nbytes
from mlxformer.engine.metrics import EngineMetrics
from mlxformer.engine.prefix_cache import PrefixCache
from mlxformer.engine.prefix_sharing import PrefixSharing
from mlxformer.engine.replay import Replays, resume_tokens, taken_back
from mlxformer.engine.scheduler import Scheduler, Step
from mlxformer.engine.sequence import Sequence
from mlxformer.engine.working_set import engine_reserve
from mlxformer.models.decoder import Model
from mlxformer.speculative.speculator import SpeculativeSettings


class Admission:
    """Caches for admitted sequences and the KV budget of each step (``Engine``'s state)."""

    model: Model
    cache_settings: CacheSettings
    speculative: SpeculativeSettings | None
    budget: KVBudget | None
    draft_tokens: int
    planner: MemoryPlanner
    scheduler: Scheduler
    runner: BatchRunner
    sharing: PrefixSharing
    prefix_cache: PrefixCache
    metrics: EngineMetrics
    replays: Replays
    _freed_last_step = False  # whether the last step freed KV buffers (``_drop_freed``)

    def _fail(self, sequence: Sequence, error: BaseException) -> None:
        raise NotImplementedError

    def _drain(self) -> bool:
        raise NotImplementedError

    def _fit(self, step: Step) -> Step:
        """``step``, or a smaller one after preemptions, whose KV fits the budget beside the prefix
        cache (evicted down to the room left)."""
        if self.budget is None:
            return step
        while (room := self.budget.limit - self.planner.step_need(self.scheduler, step)) < 0:
            victim = self.scheduler.latest_active()
            assert victim is not None
            if self._drain():  # tokens in flight are handed out first (one that ends frees its room)
                step = self.scheduler.plan(skip=self.sharing.held)
                continue
            if self.scheduler.active == 1:  # alone and still too big (submit's check prevents it)
                self._fail(victim, KVBudgetExceeded("the request outgrew the KV memory budget"))
            else:
                self._preempt(victim)
            step = self.scheduler.plan(skip=self.sharing.held)
        self.prefix_cache.evict_to(room)
        return step

    def _grow(self, step: Step) -> Step:
        """Under a KV budget, widen the pool rows that ``step``'s prompt chunks and speculation
        rounds will outgrow one layer at a time, each evaluated before the next
        (``SpareBatch.reserve``), as the decode steps widen a pool (``BatchRunner.staged``): one
        layer's buffers are held twice at most, not all of them."""
        if self.budget is None:
            return step
        fed: dict[int, int] = {}
        for chunk in step.prefill:
            fed[id(chunk.sequence)] = fed.get(id(chunk.sequence), 0) + len(chunk.tokens)
        for sequence in step.decode:
            if sequence.speculator is not None:  # a round in its row
                fed[id(sequence)] = 1 + self.draft_tokens
        for sequence in [c.sequence for c in step.prefill] + step.decode:
            tokens = fed.pop(id(sequence), 0)
            if tokens and sequence.cache:
                self.runner.reserve(sequence, tokens)
        return step

    def _preempt(self, sequence: Sequence, keep_cache: bool = True) -> None:
        """Take ``sequence`` out of the batch to be recomputed when there is room again; its caches
        go to the prefix cache (kept while room allows) unless they cannot be trusted."""
        self.metrics.preemptions.inc()
        self.sharing.held[:] = [s for s in self.sharing.held if s is not sequence]
        self.replays.stop(sequence)
        if keep_cache and held(sequence) > sequence.cached_tokens:  # it computed something worth keeping
            self._keep(sequence)
        self._unbatch(sequence)
        sequence.cache, sequence.processed = [], 0
        self.scheduler.preempt(sequence)

    def _unbatch(self, sequence: Sequence) -> None:
        """Free a leaving sequence's row (it ended, or it is preempted: its blocks were taken by
        ``_keep``) and give it all its generated tokens back."""
        self.replays.stop(sequence)
        self.runner.release(sequence)

    def _reserve(self, max_batch: int, kv_dtype: mx.Dtype) -> None:
        """Under a budget: a step's activations beside the KV (MLX's buffer cache is bounded by it)."""
        if self.budget is not None:
            per_token = self.planner.sizer.bytes_for(BLOCK) / BLOCK
            self.budget.reserve = engine_reserve(
                self.model.args, self.budget.limit, per_token, self.scheduler.step_tokens,
                self.scheduler.prefill_chunk, max_batch, self.draft_tokens, kv_dtype.size)

    def _keep(self, sequence: Sequence) -> None:
        """Offer the sequence's keys/values to the prefix cache, cut from where they are (its
        row of a batch: one copy, the blocks kept). The blocks are computed at once (under a KV
        budget before the row leaves), or a lazy block would keep the batch's old buffers alive.
        A pipelined step that fed its last token (it ended when that token was read) is taken
        back where every layer can (not a recurrent state: it is kept with every token it holds)."""
        caches = self.runner.caches(sequence)
        if (ahead := held(sequence) - (len(sequence.tokens) - 1)) > 0:
            caches = taken_back(caches, ahead)
        tokens = self._keepable(sequence.tokens[: int(caches[0].offset)], sequence.cache_salt)
        blocks = self.prefix_cache.insert(tokens, caches, sequence.cache_salt)
        arrays = [a for block in blocks for a in block.arrays()]
        if self.budget is not None:
            mx.eval(arrays)
        else:
            mx.async_eval(arrays)

    def _keepable(self, tokens: list[int], salt: str) -> list[int]:
        """The tokens of a retiring sequence whose blocks the prefix cache may cut. Under a KV
        budget the new blocks are copies held beside the sequence's row until it leaves (one layer of
        the batch twice while it does), so they must fit in what the active sequences leave:
        older blocks are evicted first, then the blocks kept are cut short. Before, a request's
        retire held its KV twice (measured: MLX's peak 135.5 MiB over the weights, budget 112.5)."""
        if self.budget is None:
            return tokens
        cache, size = self.prefix_cache, self.prefix_cache.block_size
        per_token = self.planner.sizer.bytes_for(BLOCK) / BLOCK
        active = sum(nbytes(s) for s in self.scheduler.prefilling + self.scheduler.running)
        room = self.budget.limit - active - math.ceil(active * self.planner.sizer.share(len(tokens), row=True))
        missing = sum(key not in cache.blocks for key in cache.keys_for(tokens, salt=salt))
        new = math.ceil((missing * size + len(tokens) % size) * per_token)
        if cache.nbytes + new <= room:
            return tokens
        cache.evict_to(max(room - new, 0))  # the least recently used blocks make room first
        if new <= room:
            return tokens
        return tokens[: int(max(room, 0) // (per_token * size)) * size]

    def _kv_layout(self) -> tuple:
        """What changes when KV buffers are freed: the sequences decoding and prefilling, and the
        KV bytes held (nothing without a budget)."""
        if self.budget is None:
            return ()
        active = self.scheduler.prefilling + self.scheduler.running
        return [id(s) for s in self.scheduler.running], [id(s) for s in active], self.kv_bytes()

    def _drop_freed(self, before: tuple, prompted: bool = False) -> None:
        """Under a KV budget, empty MLX's buffer cache after a step that freed KV buffers (a
        growth, a join or leave, a retire, an eviction, a sequence's last prompt chunk) or ran
        prompt chunks (``prompted``), and after the step that follows it. Buffers of those sizes
        seldom serve again: a chunk attends over a context one chunk longer than the last one's,
        so its scores never fit the cached ones (kept, they piled up while a second prompt
        prefilled beside a first's full KV: 18.2 MiB beside a 67.5 MiB budget, SmolLM2
        bfloat16), and they fill the cache that the next step's activations would reuse. The
        second clear drops the activations of that step, which are freed only once the next
        step has read its tokens (the overlap): kept, they sat in the cache through every decode
        step after the prompts (19.6 MiB beside a 59.7 MiB budget)."""
        freed = bool(before) and (prompted or self._kv_layout() != before)
        if freed or self._freed_last_step:
            mx.clear_cache()
        self._freed_last_step = freed

    def kv_bytes(self) -> int:
        raise NotImplementedError

    def _attach_cache(self, sequence: Sequence) -> None:
        """Give an admitted sequence its caches: a prefix-cache copy when one serves, else new.
        A preempted one looks up everything it had; what is missing it recomputes. Under a KV
        budget the prefix cache first leaves room for its seat (``MemoryPlanner.seat_need``: the
        hit's blocks stay while they are copied into its row, one layer at a time)."""
        resumed = bool(sequence.generated)
        scoring = sequence.prompt_scores is not None and not resumed  # scores need every position
        hit = None if scoring else self.prefix_cache.lookup(
            resume_tokens(sequence, self.prefix_cache, self.scheduler.prefill_chunk) if resumed else sequence.prompt,
            sequence.cache_salt)
        sequence.cache, cached = hit if hit is not None else (make_cache(self.model, self.cache_settings), 0)
        sequence.processed = min(cached, len(sequence.prompt))
        if resumed:
            if cached >= len(sequence.prompt):
                self.scheduler.start_decoding(sequence)
                self.replays.start(sequence, cached - len(sequence.prompt))
        else:
            sequence.cached_tokens = cached
            self.metrics.prompt_tokens.inc(len(sequence.prompt))
            self.metrics.prefix_hit_tokens.inc(cached)
            request = sequence.request
            if self.speculative is not None and request.speculate and request.constraint is None:
                sequence.speculate(self.speculative, self.cache_settings)
        if self.budget is not None:  # room for the seat first
            need = self.planner.seat_need(self.scheduler, sequence)
            self.prefix_cache.evict_to(self.budget.limit - need)
        self.runner.seat(sequence)  # its row of the pool from now on


def warm_up(model: Model, draft: Model | None, settings: CacheSettings) -> mx.Dtype:
    """Validate the cache settings in the caller's thread and run one token through the model(s)
    there: MLX arrays made lazily in a thread (weight views, for example) can only be evaluated
    by that thread, so the engine's thread must find them all evaluated. Returns the model's KV
    dtype."""
    for warm in (draft, model):
        if warm is not None:
            probe = make_cache(warm, settings)
            token = mx.array([[0]])  # a model without an LM head (embeddings only) runs its hidden states
            mx.eval(warm.last_logits(token, probe) if warm.args.head == "lm" else warm.hidden_states(token, probe))
    return next(a.dtype for a in probe[0].state if mx.issubdtype(a.dtype, mx.floating))
