"""The KV memory budget: what a sequence's caches hold at ``n`` tokens, the budget itself (bytes
or ``"auto"``), what each engine step needs of it, and MLX's memory and cache limits set from it.

The engine never measures memory after the fact: every estimate is ``KVSizer.after``, the bytes
the pools hold once their rows reach given lengths (each pool as wide as its widest row, float
rows below ``quantized_kv_start`` and quantized ones from it), plus one layer of the buffers held
now while they are rewritten (under a budget every rewrite is one layer at a time,
``BatchRunner.staged``). The submit check (``KVSizer.peak``), admission, seating and each step
ask it; the engine keeps that need and the prefix cache's bytes within ``KVBudget.limit`` by
evicting prefix entries, then preempting.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxformer.cache import CacheSettings, make_cache
from mlxformer.cache.batch_kind import PoolKey, Held, row_quantized
from mlxformer.cache.codec import quantized_at
from mlxformer.cache.state import state_nbytes
from mlxformer.engine.scheduler import Scheduler, Step
from mlxformer.engine.request_state import GenerationRequest, RequestState
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
    """Bytes of a sequence's caches at some length: as per-sequence caches (``own``: what its
    prefix blocks hold) and as its pool row (a rotating row keeps slots for a prompt chunk beyond
    its window, a recurrent row no past states), and the row's largest single layer's."""

    own: int
    row: int
    row_layer: int


class KVSizer:
    """Bytes a sequence's per-layer caches hold at ``n`` tokens, for the engine's cache settings,
    as its own caches and as its row of a pool (``row``; ``row_key``: the pool a sequence's
    caches take a row in, ``BatchRunner.row_key``, whose rotating kinds give the row's slots);
    and ``after``, the one estimate of the bytes an action leaves held (``MemoryPlanner``).

    Probed per block count and storage (float below ``quantized_kv_start``, quantized from it),
    when first asked, from the cache classes themselves (lazy zero keys/values: shapes only,
    nothing is allocated), so quantized, rotating and sliding-window caches are sized exactly
    as they store, up to the model's context; beyond it the last block's increment is
    extrapolated."""

    def __init__(self, model: Model, settings: CacheSettings, extra_tokens: int = 0,
                 row_key: Callable[[list[Held]], PoolKey] | None = None) -> None:
        args = model.args
        self.model, self.settings, self.row_key = model, settings, row_key
        self.dtype = model.kv_dtype()
        self.max_blocks = math.ceil((args.max_position_embeddings + extra_tokens) / BLOCK) + 1
        self._probed: dict[tuple[int, bool], Sizes] = {}
        # a cache turning quantized rewrites its storage all layers at once (not staged)
        self.quantizes = settings.kv_bits is not None and settings.quantized_kv_start > 0

    def quantized(self, tokens: int) -> bool:
        """Whether caches holding ``tokens`` tokens store them quantized (past ``quantized_kv_start``)."""
        return quantized_at(tokens, self.settings.kv_bits, self.settings.quantized_kv_start)

    def _probe(self, blocks: int, quantized: bool) -> Sizes:
        """Bytes of fresh caches fed ``blocks`` blocks of tokens, float or ``quantized``, and of
        their row (memoized)."""
        if blocks == 0:
            return Sizes(0, 0, 0)
        if (blocks, quantized) not in self._probed:
            n, own, row = blocks * BLOCK, [], []
            settings = dataclasses.replace(self.settings, quantized_kv_start=0, kv_bits=(
                self.settings.kv_bits if quantized else None))
            caches = make_cache(self.model, settings)
            kinds = [storage for storage, _ in self.row_key([c.held() for c in caches])] if self.row_key else [None] * len(caches)
            for index, (cache, kind) in enumerate(zip(caches, kinds)):
                if self.model.cache_layers[index].recurrent:  # a fixed size whatever the length
                    past = state_nbytes(self.model.args, cache.keep, self.dtype)
                    own.append(past)
                    # a row keeps no past states, unless it speculates: its last rounds' beside it
                    # (``StateRowCache._past``, a cache of the same ``keep``)
                    rewinds = past if self.settings.rewind else 0
                    row.append(state_nbytes(self.model.args, 0, self.dtype) + rewinds)
                    continue
                heads, key_dims, value_dims = self.model.args.cache_dims(index)  # the cache's layer's
                keys = mx.zeros((1, heads, n, key_dims), self.dtype)
                cache.update_and_fetch(keys, mx.zeros((1, heads, n, value_dims), self.dtype))
                own.append(cache.nbytes)
                row.append(cache.nbytes)
                if kind is not None and kind.capacity is not None and cache.keys is not None:
                    slots = cache.keys[0].shape[2]  # a rotating row: its slots as the pool fits them
                    row[-1] = cache.nbytes // slots * min(n, kind.capacity)
            self._probed[blocks, quantized] = Sizes(sum(own), sum(row), max(row, default=0))
        return self._probed[blocks, quantized]

    def share(self, tokens: int) -> float:
        """The largest single layer's part of a pool row's bytes at ``tokens`` tokens (what a
        rewrite done one layer at a time holds twice)."""
        if self.quantizes:  # the rewrite into quantized storage is all layers at once
            return 1.0
        sizes = self._probe(min(math.ceil(max(tokens, 1) / BLOCK), self.max_blocks), self.quantized(tokens))
        return sizes.row_layer / sizes.row if sizes.row else 0.0

    def bytes_for(self, tokens: int, row: bool = False, quantized: bool | None = None) -> int:
        """Bytes of caches holding ``tokens`` tokens (their buffers, rounded up to whole blocks);
        ``row``: of a pool row holding them; ``quantized``: in that storage (default: the one
        ``tokens`` tokens are stored in)."""
        quantized = self.quantized(tokens) if quantized is None else quantized

        def total(blocks: int) -> int:
            return self._probe(blocks, quantized).row if row else self._probe(blocks, quantized).own

        blocks = math.ceil(max(tokens, 0) / BLOCK)
        if blocks <= self.max_blocks:
            return total(blocks)
        last, before = total(self.max_blocks), total(self.max_blocks - 1)
        return last + (blocks - self.max_blocks) * (last - before)

    def after(self, rows: Sequence[int], current: int = 0, stored: Sequence[bool | None] = ()) -> int:
        """KV bytes held while the pools are brought to rows of ``rows`` tokens each, from the
        ``current`` bytes they hold (the one estimate behind the check, admission, seating and
        each step): each pool's rows as wide as its widest (one pool of float rows below
        ``quantized_kv_start``, one of quantized rows from it; ``stored``: each row's storage
        where it is known, a row that passed ``start`` in a float chunk is float until its next
        step), never less than what is held; and, when that rewrites buffers (a row added, the
        rows widened, a row turning quantized), what is held now held twice one layer at a time
        (``share``; all layers at once when rows turn quantized)."""
        pools: dict[bool, list[int]] = {}
        for tokens, quantized in itertools.zip_longest(rows, stored):
            pools.setdefault(self.quantized(tokens) if quantized is None else quantized, []).append(tokens)
        total = sum(len(pool) * self.bytes_for(max(pool), True, quantized) for quantized, pool in pools.items())
        if total <= current:
            return current
        return total + math.ceil(current * self.share(max(rows)))

    def ends(self, tokens: int) -> list[int]:
        """The lengths at which a row on its way to ``tokens`` tokens is largest in each storage:
        past ``quantized_kv_start``, its float row at its longest (``start`` tokens) and its end."""
        start = self.settings.quantized_kv_start
        return [start, tokens] if self.quantizes and tokens > start else [tokens]

    def peak(self, tokens: int) -> int:
        """The most a lone request needs on its way to ``tokens`` tokens: its row at its end with
        one layer of it held twice (rewritten at a growth, or written at a seat from a prefix
        hit's blocks), and, past ``quantized_kv_start``, ``after`` as it turns quantized (its
        float row beside its quantized one) and its float row at its largest."""
        start, ends = self.settings.quantized_kv_start, self.ends(tokens)
        need = max(self.bytes_for(n, row=True) + math.ceil(self.bytes_for(n, row=True) * self.share(n))
                   for n in ends)
        if len(ends) > 1:
            need = max(need, self.after([start + 1], self.bytes_for(start, row=True)))
        return need


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


def nbytes(sequence: RequestState) -> int:
    """Bytes the sequence's caches hold (its share of a batch's buffers)."""
    return sum(c.nbytes for c in sequence.cache)


def stored_quantized(sequence: RequestState) -> bool | None:
    """Whether the sequence's row stores its keys quantized now (None: it has no row yet)."""
    return row_quantized(sequence.cache[0].row) if sequence.cache else None  # type: ignore[attr-defined]


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

    def admissible(self, scheduler: Scheduler, sequence: RequestState) -> bool:
        """Whether ``sequence`` fits beside the active ones (the prefix cache can be evicted) with
        headroom: its row added to the pool and brought to its prompt's length (and the rows not
        quantized yet at their longest as float rows, ``KVSizer.ends``), and the pool's next
        growth (every row one buffer block wider) when some row will reach it. Without that headroom a sequence admitted into the last free bytes is preempted at its
        next block and re-admitted as soon as one frees (measured: 34 preemptions over 16
        requests, 0.15x the unbudgeted throughput; counted as quantized, a prompt crossing
        ``quantized_kv_start`` was preempted before its first chunk at every step)."""
        active = scheduler.active
        if self.budget is None or not active:
            return True
        current = sum(nbytes(s) for s in active)
        rows = [len(s.tokens) + 1 for s in active] + [len(sequence.tokens)]
        stored = [stored_quantized(s) for s in active] + [False]
        # the rows not quantized yet at their longest float length (``ends``), beside the others
        floats = [n if quantized else max(s.cache_offset, self.sizer.ends(n)[0])
                  for s, n, quantized in zip([*active, sequence], rows, stored)]
        seated = self.sizer.after([s.cache_offset for s in active] + [0], current, stored)  # once it has its row
        need = max(self.sizer.after(rows, seated), self.sizer.after(floats, seated, stored))
        grown = math.ceil(max(rows) / BLOCK) * BLOCK + 1  # tokens at which every row's buffer gains a block
        if any(len(s.tokens) + s.room >= grown for s in [*active, sequence]):
            need = max(need, self.sizer.after([grown] * len(rows), self.sizer.after(rows)))
        return need <= self.budget.limit

    def seat_need(self, scheduler: Scheduler, sequence: RequestState, layers: Sequence[Held]) -> int:
        """KV bytes held while ``sequence`` (admitted: its layers holding ``layers``, nothing
        yet or a prefix-cache hit's tokens, which stay in the hit's blocks until copied) takes
        its row: the pool with one row more (``KVPool.seat`` rewrites it one layer at a
        time). The prefix cache must leave this room before the seat (``Admission.seat``)."""
        active = [s for s in scheduler.active if s is not sequence and s.cache]
        rows = [s.cache_offset for s in active] + [layers[0].offset]
        stored = [stored_quantized(s) for s in active] + [None]
        return self.sizer.after(rows, sum(nbytes(s) for s in active) + sum(h.nbytes for h in layers), stored)

    def step_need(self, scheduler: Scheduler, step: Step) -> int:
        """KV bytes the active sequences hold while ``step`` runs: every row brought to its
        length after the step (a prompt's chunks, a speculation round, a decode token; a row not
        stepping writes a scratch slot, ``BatchLayout.prepare``)."""
        fed = step.fed(self.draft_tokens)
        rows = [s for s in scheduler.active if s.cache]  # (not one waiting for its caches)
        if not rows:
            return 0
        return self.sizer.after([s.cache_offset + max(fed.get(id(s), 0), 1) for s in rows], sum(nbytes(s) for s in rows))
