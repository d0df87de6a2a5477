"""The KV memory budget: what a sequence's caches hold at ``n`` tokens, the budget itself (bytes
or ``"auto"``), what each engine step needs of it, and MLX's memory and cache limits set from it.

The engine never measures memory after the fact: before each step it adds up what every active
sequence will hold once the step has run (``KVSizer.step_need``: the cache at its new length,
plus one layer's old buffers while a growing cache is rewritten: under a budget the engine
rewrites buffers, a sequence's or a decode batch's, one layer at a time, ``BatchRunner.staged``),
and the prefix cache's bytes, and keeps that sum within ``KVBudget.limit`` by evicting prefix
entries, then preempting. A request's peak is thus its own size plus one layer's old buffer.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from typing import Callable, NamedTuple

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxformer.cache import Cache, CacheSettings, make_cache
from mlxformer.cache.batch_kind import BatchKey
from mlxformer.cache.state import StateCache, state_nbytes
from mlxformer.engine.scheduler import Scheduler, Step
from mlxformer.engine.sequence import GenerationRequest, Sequence
from mlxformer.errors import MlxformerError
from mlxformer.models.decoder import Model

BLOCK = 256  # tokens: the caches grow their buffers in blocks of this size
MIN_MARGIN = 512 * 2**20  # bytes kept free beside weights and KV for activations and MLX's buffer cache
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


class KVBudgetExceeded(MlxformerError):
    """A request whose KV cache can never fit in the engine's KV memory budget."""


def parse_kv_memory(text: str) -> int | str:
    """``"auto"`` or a byte count such as ``"1500000000"``, ``"512MiB"``, ``"2G"``, ``"1.5GB"``."""
    value = text.strip().lower()
    if value == "auto":
        return "auto"
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?", value)
    if match is None:
        raise MlxformerError(f"--max-kv-memory must be a byte count (e.g. 2GiB, 512M, 1000000) or auto, got {text!r}")
    number = float(match.group(1)) * _UNITS[match.group(2) or ""]
    if number < 1:
        raise MlxformerError("--max-kv-memory must be at least 1 byte")
    return int(number)


def weights_nbytes(model: Model) -> int:
    """Bytes of the model's parameters."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def device_memory() -> int:
    """The memory MLX may use on the default device: the recommended working set on Apple
    silicon (what MLX reports), else the device's memory, else the machine's RAM."""
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "total_memory", "memory_size"):
        if isinstance(info.get(key), int) and int(info[key]) > 0:
            return int(info[key])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def margin_for(total: int) -> int:
    """Memory kept free for activations and freed-buffer reuse: a tenth of ``total``, at least 512 MiB."""
    return max(MIN_MARGIN, total // 10)


def auto_kv_budget(model: Model) -> int:
    """``auto``: the device's memory less the weights and a margin."""
    memory = device_memory()
    budget = memory - weights_nbytes(model) - margin_for(memory)
    if budget <= 0:
        raise MlxformerError(
            f"--max-kv-memory auto: the weights ({weights_nbytes(model) / 2**30:.1f} GiB) leave no room for a KV cache "
            f"in {memory / 2**30:.1f} GiB; give a byte count"
        )
    return budget


class Sizes(NamedTuple):
    """Bytes of a sequence's caches at some length: its own caches' and its decode-batch row's
    (a rotating row keeps slots for a prompt chunk beyond its window, a recurrent row no past
    states), each in all and the largest single layer's."""

    own: int
    own_layer: int
    row: int
    row_layer: int


class KVSizer:
    """Bytes a sequence's per-layer caches hold at ``n`` tokens, for the engine's cache settings,
    as its own caches and as its row of a decode batch (``row``; ``row_key``: the batch a
    sequence's caches join, ``BatchRunner.row_key``, whose rotating kinds give the row's slots).

    Probed per block count, when first asked, from the cache classes themselves (lazy zero
    keys/values: shapes only, nothing is allocated), so quantized, rotating and sliding-window
    caches are sized exactly as they store, up to the model's context; beyond it the last
    block's increment is extrapolated."""

    def __init__(self, model: Model, settings: CacheSettings, extra_tokens: int = 0,
                 row_key: Callable[[list[Cache]], BatchKey] | None = None) -> None:
        args = model.args
        self.model, self.settings, self.row_key = model, settings, row_key
        self.dtype = model.hidden_states(mx.array([[0]])).dtype  # the keys' dtype (lazy: never evaluated)
        self.max_blocks = math.ceil((args.max_position_embeddings + extra_tokens) / BLOCK) + 1
        self._probed: dict[int, Sizes] = {0: Sizes(0, 0, 0, 0)}
        # a cache turning quantized rewrites its storage all layers at once (not staged)
        self.quantizes = settings.kv_bits is not None and settings.quantized_kv_start > 0

    def _probe(self, blocks: int) -> Sizes:
        """Bytes of fresh caches fed ``blocks`` blocks of tokens, and of their row (memoized)."""
        if blocks not in self._probed:
            n, own, row = blocks * BLOCK, [], []
            start = self.settings.quantized_kv_start if self.settings.kv_bits is not None else 0
            caches = make_cache(self.model, self.settings)
            kinds = [storage for storage, _ in self.row_key(caches)] if self.row_key else [None] * len(caches)
            for index, (cache, kind) in enumerate(zip(caches, kinds)):
                if isinstance(cache, StateCache):  # a fixed size whatever the length
                    past = state_nbytes(self.model.args, cache.keep, self.dtype)
                    own.append(past if blocks else 0)
                    # a row keeps no past states, unless it speculates: its last rounds' beside it
                    # (``StateRowCache._past``, a cache of the same ``keep``)
                    rewinds = past if self.settings.rewind else 0
                    row.append(state_nbytes(self.model.args, 0, self.dtype) + rewinds if blocks else 0)
                    continue
                heads, key_dims, value_dims = self.model.args.cache_dims(index)  # the cache's layer's
                for length in ([start, n - start] if 0 < start < n else [n]):
                    keys = mx.zeros((1, heads, length, key_dims), self.dtype)
                    cache.update_and_fetch(keys, mx.zeros((1, heads, length, value_dims), self.dtype))
                own.append(cache.nbytes)
                row.append(cache.nbytes)
                if kind is not None and kind.capacity is not None and cache.keys is not None:
                    slots = cache.keys[0].shape[2]  # a rotating row: its slots as the batch fits them
                    row[-1] = cache.nbytes // slots * min(n, kind.capacity)
            self._probed[blocks] = Sizes(sum(own), max(own, default=0), sum(row), max(row, default=0))
        return self._probed[blocks]

    def share(self, tokens: int, row: bool = False) -> float:
        """The largest single layer's part of the caches' bytes at ``tokens`` tokens (what a
        rewrite done one layer at a time holds twice); ``row``: of a decode-batch row."""
        if self.quantizes:  # the rewrite into quantized storage is all layers at once
            return 1.0
        sizes = self._probe(min(math.ceil(max(tokens, 1) / BLOCK), self.max_blocks))
        total, layer = (sizes.row, sizes.row_layer) if row else (sizes.own, sizes.own_layer)
        return layer / total if total else 0.0

    def bytes_for(self, tokens: int, row: bool = False) -> int:
        """Bytes of caches holding ``tokens`` tokens (their buffers, rounded up to whole blocks);
        ``row``: of a decode-batch row holding them."""
        def total(blocks: int) -> int:
            return self._probe(blocks).row if row else self._probe(blocks).own

        blocks = math.ceil(max(tokens, 0) / BLOCK)
        if blocks <= self.max_blocks:
            return total(blocks)
        last, before = total(self.max_blocks), total(self.max_blocks - 1)
        return last + (blocks - self.max_blocks) * (last - before)

    def step_need(self, held: int, fed: int, current: int | None = None) -> int:
        """Bytes while caches holding ``held`` tokens take ``fed`` more: the new buffers, plus one
        layer's old ones while a growing buffer is rewritten (layer by layer). ``current``: the
        bytes the caches really hold (a cache assembled from prefix blocks is exactly as long as
        its tokens, and grows by a whole block from there)."""
        after, before = self.bytes_for(held + fed), self.bytes_for(held)
        if current is None:
            return after + (math.ceil(before * self.share(held)) if after != before else 0)
        per_token = self._probe(1).own / BLOCK
        if fed == 0 or held + fed <= current / per_token:  # fits in the buffers it has
            return max(after, current)
        grown_tokens = held + math.ceil(fed / BLOCK) * BLOCK
        grown = min(int(per_token * grown_tokens), self.bytes_for(grown_tokens))
        return max(after, grown) + math.ceil(current * self.share(held))

    def peak(self, tokens: int) -> int:
        """The most a lone sequence needs on its way to ``tokens`` tokens: its size, plus one
        layer held twice while it is rewritten (at a growth, a seat or a leave); the more of its
        own caches' and its decode-batch row's (where it lives from admission under a budget: a
        rotating row holds more, a recurrent row less)."""
        own, row = self.bytes_for(tokens), self.bytes_for(tokens, row=True)
        return max(own + math.ceil(own * self.share(tokens)), row + math.ceil(row * self.share(tokens, row=True)))


@dataclass
class KVBudget:
    """The KV bytes the engine may hold (sequences and prefix cache together), and the MLX
    memory and cache limits derived from it, set while the engine runs. ``reserve``: the
    activations one step may hold beside the KV (``working_set.step_reserve``), also the
    bound of MLX's freed-buffer cache, so the process grows over its weights by at most
    ``limit + 2 * reserve`` (``describe``)."""

    limit: int
    weights: int
    reserve: int = 0

    @property
    def mlx_memory_limit(self) -> int:
        """MLX's memory limit: weights, KV budget and the margin."""
        return self.weights + self.limit + margin_for(self.weights + self.limit)

    @property
    def mlx_cache_limit(self) -> int:
        """MLX's freed-buffer cache limit: one step's activations (``reserve``), kept for the next
        step, never more than the margin. Before, the margin (512 MiB at least): freed KV buffers
        of every size piled up in it (measured: 301 MiB beside a 112.5 MiB budget,
        ``docs/design/scheduler-measurements.md``)."""
        return min(self.reserve, margin_for(self.weights + self.limit))

    def describe(self) -> str:
        """One line for the server's start: the budget, the step reserve, the bound on growth."""
        mib = 2**20
        return (f"KV budget {self.limit / mib:.1f} MiB; a step's activations up to {self.reserve / mib:.1f} MiB and "
                f"MLX's buffer cache within that again: memory above the weights ({self.weights / mib:.1f} MiB) "
                f"up to {(self.limit + 2 * self.reserve) / mib:.1f} MiB")

    def apply(self) -> tuple[int, int]:
        """Set MLX's limits; returns the previous ``(memory limit, cache limit)``."""
        return mx.set_memory_limit(self.mlx_memory_limit), mx.set_cache_limit(self.mlx_cache_limit)

    @staticmethod
    def restore(previous: tuple[int, int]) -> None:
        """Put back the limits ``apply`` returned."""
        mx.set_memory_limit(previous[0])
        mx.set_cache_limit(previous[1])


def resolve_budget(model: Model, max_kv_memory: int | str | None) -> KVBudget | None:
    """The budget for ``max_kv_memory`` (bytes, ``"auto"`` or None for none)."""
    if max_kv_memory is None:
        return None
    if isinstance(max_kv_memory, str):
        max_kv_memory = parse_kv_memory(max_kv_memory)
    limit = auto_kv_budget(model) if max_kv_memory == "auto" else int(max_kv_memory)
    if limit < 1:
        raise MlxformerError("max_kv_memory must be at least 1 byte")
    return KVBudget(limit, weights_nbytes(model))


def held(sequence: Sequence) -> int:
    """Tokens the sequence's caches hold."""
    return int(sequence.cache[0].offset) if sequence.cache else 0


def nbytes(sequence: Sequence) -> int:
    """Bytes the sequence's caches hold (its share of a batch's buffers)."""
    return sum(c.nbytes for c in sequence.cache)


class MemoryPlanner:
    """What the scheduler's sequences need of the budget: at admission and for each step."""

    def __init__(self, sizer: KVSizer, budget: KVBudget | None, draft_tokens: int) -> None:
        self.sizer, self.budget, self.draft_tokens = sizer, budget, draft_tokens

    def fitted(self, request: GenerationRequest) -> GenerationRequest:
        """``request`` with a default ``max_tokens`` (``fit_budget``) cut to the most the budget
        can hold for its prompt, alone (unchanged without a budget, or when not even one token fits)."""
        if self.budget is None or not request.fit_budget:
            return request
        fits = lambda n: self.sizer.peak(len(request.prompt_ids) + n + self.draft_tokens) <= self.budget.limit  # noqa: E731
        low, high = 0, request.max_tokens  # fits(low) or low == 0; the answer is in [low, high]
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if fits(middle) else (low, middle - 1)
        return dataclasses.replace(request, max_tokens=low) if 0 < low < request.max_tokens else request

    def check(self, request: GenerationRequest) -> None:
        """Raise ``KVBudgetExceeded`` for a request that can never fit the budget, even alone."""
        if self.budget is None:
            return
        tokens = len(request.prompt_ids) + request.max_tokens + self.draft_tokens
        if (need := self.sizer.peak(tokens)) > self.budget.limit:
            raise KVBudgetExceeded(
                f"this request needs up to {need / 2**20:.1f} MiB of KV cache ({len(request.prompt_ids)} prompt tokens "
                f"+ max_tokens {request.max_tokens}), more than the engine's budget of {self.budget.limit / 2**20:.1f} MiB; "
                "use a shorter prompt or a smaller max_tokens"
            )

    def admissible(self, scheduler: Scheduler, sequence: Sequence, batched: Callable[[Sequence], bool]) -> bool:
        """Whether ``sequence`` fits beside the active ones (the prefix cache can be evicted) with
        headroom: through its prefill, through joining the decode batch, and through the batch's
        next growth (every row one buffer block wider) when some row will reach it. Without that
        headroom a sequence admitted into the last free bytes is preempted at its next block and
        re-admitted as soon as one frees (measured: 34 preemptions over 16 requests, 0.15x the
        unbudgeted throughput). A join or a growth rewrites the batch one layer at a time, so
        each holds one layer twice at most (before: the whole batch, ``2 * rows - 1`` rows
        while a row joined)."""
        if self.budget is None or not scheduler.active:
            return True
        active = scheduler.prefilling + scheduler.running
        alone = [s for s in active if s.speculator is not None and not batched(s)]  # on their own caches
        rows = [s for s in active if s.speculator is None or batched(s)] + [sequence]
        alone_need = sum(self.sizer.bytes_for(len(s.tokens) + 1 + self.draft_tokens) for s in alone)
        prefill = (sum(self.sizer.bytes_for(len(s.tokens) + 1, row=True) for s in rows[:-1])
                   + self.sizer.peak(len(sequence.tokens)))
        width = max(len(s.tokens) for s in rows) + 1
        join = self._rewritten(rows, batched, width)
        grown = math.ceil(width / BLOCK) * BLOCK + 1  # tokens at which every row's buffer gains a block
        now, wider = self.sizer.bytes_for(width, row=True), self.sizer.bytes_for(grown, row=True)
        growth = 0
        if wider > now and any(len(s.tokens) + s.room >= grown for s in rows):
            growth = len(rows) * wider + math.ceil(len(rows) * now * self.sizer.share(width, row=True))
        return alone_need + max(prefill, join, growth) <= self.budget.limit

    def seat_need(self, scheduler: Scheduler, sequence: Sequence, batched: Callable[[Sequence], bool]) -> int:
        """KV bytes the active sequences hold while ``sequence`` (admitted: its caches new, or a
        prefix-cache hit whose tokens stay in the hit's blocks) takes its row: the others' as
        they are, and the batch with its row, one layer of it held twice (``SpareBatch.seat``
        rewrites it one layer at a time: the batch's old layer beside the new, with the hit's
        layer read out of its blocks, at most a row's). The prefix cache must leave this room
        before the seat (``Admission._attach_cache``): the blocks being copied stay, evicted or
        not, until their layer is in the row. Before, the row was written whole beside the hit's
        tokens (held twice, not counted): MLX's peak rose by the row plus 9.3 layers of the hit
        (``docs/design/scheduler-measurements.md``)."""
        active = [s for s in scheduler.prefilling + scheduler.running if s is not sequence]
        rows = [s for s in active if batched(s)] + [sequence]
        width = max(held(s) for s in rows)
        return sum(nbytes(s) for s in active if not batched(s)) + self._rewritten(rows, batched, width)

    def _rewritten(self, rows: list[Sequence], batched: Callable[[Sequence], bool], width: int) -> int:
        """Bytes of a decode batch of ``rows`` at ``width`` tokens rewritten one layer at a time:
        the batch, and one layer of it held twice."""
        batch = len(rows) * self._row_bytes(rows, batched, width)
        return batch + math.ceil(batch * self.sizer.share(width, row=True))

    def _rows_need(self, rows: list[Sequence], batched: Callable[[Sequence], bool], width: int) -> int:
        """Bytes of a decode batch of ``rows`` at ``width`` tokens: the batch's buffers are as wide
        as its longest row (``cache/batch.py``), so rows times a row's bytes, plus one layer of
        the old buffers while they are rewritten (the batch grows, or rows join it)."""
        current = sum(c.nbytes for s in rows if batched(s) for c in s.cache)
        after = len(rows) * self._row_bytes(rows, batched, width)
        if after <= current:
            return after
        old = sum(c.nbytes for s in rows for c in s.cache)  # the batch and the joining rows' own caches
        return after + math.ceil(old * self.sizer.share(width, row=True))

    def _row_bytes(self, rows: list[Sequence], batched: Callable[[Sequence], bool], width: int) -> int:
        """Bytes of one decode-batch row at ``width`` tokens (``KVSizer``'s ``row``: a rotating
        row's slots beyond its window, a recurrent row's states), never less than a row of the
        batch's buffers as they are."""
        members = [s for s in rows if batched(s)]
        current = sum(c.nbytes for s in members for c in s.cache) // max(1, len(members))
        return max(self.sizer.bytes_for(width, row=True), current)

    def step_need(self, scheduler: Scheduler, step: Step, batched: Callable[[Sequence], bool]) -> int:
        """KV bytes the active sequences need while ``step`` runs. The decoding sequences share a
        batch buffer as wide as its longest row ever was (``cache/batch.py``): rows times a row's
        bytes, plus the old buffer while it is rewritten (``_rows_need``). A sequence seated in
        its row at admission (``cache/rows.py``: prefilling, or speculating) is one of those rows,
        as wide as the batch, and its chunk or round widens every row; the others grow their
        own caches."""
        fed: dict[int, int] = {}
        for chunk in step.prefill:  # a sequence may run several chunks in one step
            fed[id(chunk.sequence)] = fed.get(id(chunk.sequence), 0) + len(chunk.tokens)
        need, rows = 0, []
        for sequence in scheduler.prefilling:
            if batched(sequence):  # seated: its chunks write into its row
                rows.append(sequence)
            else:
                need += self.sizer.step_need(held(sequence), fed.get(id(sequence), 0), nbytes(sequence))
        for sequence in scheduler.running:
            if sequence.speculator is not None:
                fed[id(sequence)] = 1 + self.draft_tokens  # a round (or one token)
                if not batched(sequence):  # on its own caches
                    need += self.sizer.step_need(held(sequence), fed[id(sequence)], nbytes(sequence))
                    continue
            rows.append(sequence)
        if rows:  # each row takes its tokens, or a scratch slot (``BatchLayout.prepare``)
            need += self._rows_need(rows, batched, max(held(s) + max(fed.get(id(s), 0), 1) for s in rows))
        return need
