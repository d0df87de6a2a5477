"""Runs the one decoder over a batch of sequences.

Every sequence lives in its row of a pool (``cache/pool.py``) from admission (``seat``) to
retirement (``release``): its prompt chunks, its speculation rounds and its decode steps write
there. An engine step runs the decoding rows, the prompt chunks and the speculation rounds in
one forward (``step``, ``cache/packed.py``: every segment writes before any attends, so every
row is written in place); a pool's decode rows are one cache write and one attention per layer,
each row rotated at its own position and masked to its own slots (a model mixing sliding-window
and global layers, such as Gemma 2/3, keeps one slot layout per kind of layer).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple, Protocol, Sequence

import mlx.core as mx

from mlxformer.adapters.layers import Weights, select
from mlxformer.cache import Cache
from mlxformer.cache.packed import PackedLayerCache, StepSegment, positions
from mlxformer.engine.prompt_scores import PromptScores
from mlxformer.cache.batch_kind import PoolKey, Held, pool_key, row_quantizes_next
from mlxformer.cache.row_place import RowPlace, seated
from mlxformer.cache.rotating_rows import ring_key
from mlxformer.cache.pool import KVPool, blanks
from mlxformer.models.decoder import Attention, Model
from mlxformer.models.gated_delta import GatedDeltaNet
from mlxformer.models.mla import MLAttention
from mlxformer.models.rope import RoPE


class Decoding(Protocol):
    """What the runner needs of a decoding sequence."""

    cache: list  # its per-layer caches: views of its pool row once seated (``seat``)
    speculator: object | None  # a speculating sequence decodes alone on its row (a group of its own)
    adapters: Weights  # its adapters' weights (``adapters.select``; None: the base model)

    @property
    def last_token(self) -> int: ...


class StepGroup(NamedTuple):
    """Decoding rows stepping together: a pool's rows (its step caches, ``pool`` set), or one
    speculating sequence on its row alone (its own views, ``pool`` None)."""

    caches: Sequence[Cache]
    rows: list[Decoding]
    pool: KVPool | None


@dataclass(frozen=True)
class TokenRun:
    """A piece of one sequence's prompt for ``BatchRunner.step`` (or a speculation round:
    ``speculation_round``)."""

    tokens: Sequence[int] | mx.array
    cache: Sequence[Cache]  # the sequence's caches (views of its pool row)
    last: bool  # the chunk ends the prompt: its last logits are wanted
    prompt_length: int | None  # the whole prompt's (dynamic NTK's base depends on it)
    every: bool = False  # every position's logits are wanted ``(T, vocab)`` (a speculation round's)
    adapters: Weights = None  # its sequence's adapters' weights

    @property
    def wanted(self) -> int:
        """How many of its positions' logits are wanted (its last ones)."""
        return len(self.tokens) if self.every else int(self.last)


def speculation_round(last: int, proposed: mx.array, cache: Sequence[Cache], adapters: Weights = None) -> TokenRun:
    """A speculation round for ``BatchRunner.step``: the ``last`` token then the proposals
    ``(k,)`` (maybe still on the device) on one sequence's caches, every position's logits wanted."""
    tokens = mx.concatenate([mx.array([last], mx.int32), proposed.astype(mx.int32)])  # (k + 1,)
    return TokenRun(tokens, cache, True, None, every=True, adapters=adapters)


def packs(model: Model) -> bool:
    """Whether a step's tokens can share one forward (``cache/packed.py``): every layer is
    attention, grouped-query or latent (MLA), whose RoPE takes a position per token (not
    dynamic NTK nor LongRoPE, whose rotation depends on each sequence's length), or a recurrent
    layer (each segment scans from its own state)."""
    for layer in model.layers:
        attention = layer[layer.mixer_name]
        if isinstance(attention, GatedDeltaNet):
            continue
        if not isinstance(attention, (Attention, MLAttention)):
            return False
        rope = attention.rope
        if rope is not None and not (isinstance(rope, RoPE) and rope.config.type != "dynamic"):
            return False
    return True


class BatchRunner:
    """Turns the scheduled work into decoder calls: prompt chunks and batched decode steps."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.windows = [layer.window for layer in model.cache_layers]  # one per cache
        # whether a later layer reads each cache's keys/values (Gemma 4's KV sharing)
        self.read = [bool(getattr(layer[layer.mixer_name], "kv_read", False)) for layer in model.cache_layers]
        # a layer whose row says when the keys turn quantized (an attention layer, not a recurrent one)
        self.kv_layer = next((i for i, layer in enumerate(model.cache_layers) if not layer.recurrent), 0)
        self.packs = packs(model)
        self.pools: dict[PoolKey, KVPool] = {}
        # rewrite a pool's buffers (a seat, a leave, wider rows) one layer at a time, each
        # evaluated before the next: only one layer is ever held twice (set under a KV budget)
        self.staged = False
        self.max_rows: int | None = None  # a pool's spare rows grow up to this (the engine's max_batch)
        # the tokens of a prompt chunk (the engine's prefill_chunk): a rotating row keeps slots
        # for one beyond its window (``cache/rotating_rows.py``; a longer chunk goes in pieces)
        self.prefill_chunk: int | None = None
        self._dtype: mx.Dtype | None = None  # the keys' dtype (the model's), found when first needed

    def seat(self, sequence: Decoding, held: list[Held | None] | None = None) -> None:
        """Give an admitted sequence its row in the pool of its kind (``cache/pool.py``), holding
        ``held`` (a prefix-cache hit's; default: what its caches hold, which it lets go of, so
        that a seat under a KV budget drops each layer once it is in the row): its prompt
        chunks, its speculation rounds and its decode steps all write there, until it leaves
        (``release``)."""
        if held is None:
            held, sequence.cache = [c.held() for c in sequence.cache], []
        sequence.cache = self._seat_in(held, sequence.speculator is not None)

    def row_key(self, held: Sequence[Held]) -> PoolKey:
        """The pool a sequence whose layers hold ``held`` takes a row in (a rotating layer's rows
        keep slots beyond the window for a prompt chunk: what the KV budget counts for a row,
        ``memory.KVSizer``)."""
        return ring_key(pool_key(held, self.windows), self.prefill_chunk or 1)

    def _pool(self, kind: PoolKey) -> KVPool:
        """The pool of ``kind``, made when first needed."""
        if kind not in self.pools:
            self._dtype = self._dtype or self.model.kv_dtype()
            self.pools[kind] = KVPool(kind, blanks(self.model.args, self._dtype, kind), self.max_rows, self.staged)
        return self.pools[kind]

    def reserve(self, sequence: Decoding, tokens: int) -> None:
        """Widen the pool's rows before ``sequence`` writes ``tokens`` more into its row (a prompt
        chunk, a speculation round: ``KVPool.reserve``, one layer at a time)."""
        sequence.cache[0].pool.reserve(int(sequence.cache[0].offset) + tokens)

    def _seat_in(self, held: list[Held | None], rewinds: bool) -> list[Cache]:
        """A row holding ``held`` in the pool of its kind (``KVPool.seat``); the views of the
        row. A speculating sequence's row keeps its recurrent layers' last states (``rewinds``:
        a rejected round is taken back, ``cache/state_rows.py``)."""
        pool = self._pool(self.row_key(held))  # type: ignore[arg-type]
        index, views = pool.seat(held)
        pool.layout.rows[index].rewinds = rewinds
        return views  # type: ignore[return-value]

    def prefill(
        self, tokens: Sequence[int], cache: Sequence[Cache], want_logits: bool, prompt_length: int | None = None,
        scores: PromptScores | None = None, start: int = 0,
    ) -> mx.array | None:
        """Run one prompt chunk through one sequence's caches; the last position's logits
        ``(1, vocab)`` when ``want_logits`` (lazy), else None (the cache is evaluated).
        ``prompt_length``: the whole prompt's (RoPE's dynamic base depends on it). ``scores``:
        every position's logits also score the prompt's tokens (the chunk starts at ``start``).
        The caller selects the sequence's adapters, if any (``adapters.select``)."""
        self._cross(cache)
        inputs = mx.array(tokens)[None]  # (1, T)
        if scores is not None:
            hidden = self.model.hidden_states(inputs, cache, rope_length=prompt_length)
            logits = self.model.logits(hidden)[0]  # (1, T, vocab) -> (T, vocab)
            mx.eval([*scores.add(start, logits), *(c.state for c in cache)])  # on this (the engine's) thread
            return logits[-1:] if want_logits else None
        if want_logits:
            return self.model.last_logits(inputs, cache, rope_length=prompt_length)
        self.model.hidden_states(inputs, cache, rope_length=prompt_length)
        mx.eval([c.state for c in cache])
        return None

    def verify(self, last: int, proposed: mx.array, cache: Sequence[Cache], adapters: Weights = None) -> mx.array:
        """A speculation round on one sequence's caches, in a forward of its own: the ``last``
        token then the proposals ``(k,)`` (maybe still on the device) in, every position's
        logits ``(k + 1, vocab)`` out (lazy). Beside a decode step, pass it to ``step`` instead."""
        logits = self._alone(speculation_round(last, proposed, cache, adapters))
        assert logits is not None
        return logits

    def _alone(self, chunk: TokenRun) -> mx.array | None:
        """A chunk (or a round) in a forward of its own: ``prefill``'s logits, or every position's."""
        with select(self.model, [(chunk, 1)]):
            if not chunk.every:
                return self.prefill(chunk.tokens, chunk.cache, chunk.last, chunk.prompt_length)
            return self.model(mx.array(chunk.tokens)[None], chunk.cache)[0]  # (1, k + 1, vocab) -> (k + 1, vocab)

    def decode(self, sequences: Sequence[Decoding]) -> mx.array:
        """One token per sequence in, next-token logits ``(B, vocab)`` in the same order out (lazy)."""
        logits, _ = self.step(sequences)
        assert logits is not None
        return logits

    def step(
        self, sequences: Sequence[Decoding], chunks: Sequence[TokenRun] = (), inputs: mx.array | None = None
    ) -> tuple[mx.array | None, list[mx.array | None]]:
        """One engine step in one forward (``cache/packed.py``): one token per decoding sequence
        and each prompt chunk's (or speculation round's) tokens on its sequence's row (a prompt's
        chunks in order). Returns the next-token logits ``(B, vocab)`` in the order of
        ``sequences`` (None without any) and each chunk's last logits ``(1, vocab)`` when it
        wants them, a round's every position's ``(k + 1, vocab)`` (lazy; a chunk that wants
        none is evaluated). A model whose RoPE depends on each sequence's length runs one
        forward per pool and per chunk instead.

        Every sequence is seated (``seat``); one whose storage turns quantized this step moves to
        a row of the quantized pool first (``_cross``), and one that speculates steps on its row
        as a group of its own (``_groups``).
        ``inputs``: the tokens ``(B,)`` the sequences take, in their order (maybe still on the
        device: a pipelined step's); default: their last tokens."""
        for chunk in chunks:
            if not chunk.every:  # a round does not move its row (the decode steps do, ``_groups``)
                self._cross(chunk.cache)  # type: ignore[arg-type]
        groups = self._groups(sequences)
        place = {id(s): i for i, s in enumerate(sequences)}
        order = [place[id(s)] for group in groups for s in group.rows]  # the grouped rows' places in ``sequences``
        assert len(order) == len(sequences), "every decoding sequence is seated"
        tokens = self._tokens(groups, order, inputs)
        # one pool alone needs no packing; a prompt whose row moves between its chunks cannot share one forward
        if self.packs and len(groups) + len(chunks) > 1 and not self._crosses_within(chunks):
            parts, chunk_logits = self._packed(groups, tokens, chunks)
        else:
            parts, chunk_logits = self._one_by_one(groups, tokens, chunks)
        if not parts:
            return None, chunk_logits
        logits = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
        wanted = sorted(range(len(order)), key=order.__getitem__)  # each sequence's row of ``logits``
        if wanted == list(range(len(wanted))):
            return logits, chunk_logits
        return logits[mx.array(wanted)], chunk_logits

    def _one_by_one(
        self, groups: list[StepGroup], tokens: list[mx.array],
        chunks: Sequence[TokenRun],
    ) -> tuple[list[mx.array], list[mx.array | None]]:
        """``step`` as one forward per pool, per speculating sequence's row and per chunk (a
        model that does not pack, a step of one part, a prompt's chunks crossing within it). A
        forward writing a row of a pool that an earlier forward read is built once that one is
        evaluated: the earlier attention would otherwise still read the buffer the write
        replaces, and MLX would copy the buffer instead of writing it in place
        (``cache/packed.py`` orders the writes instead)."""
        reading: dict[int, list[mx.array]] = {}  # id(pool) -> the outputs not yet evaluated of forwards reading it

        def before(caches: Sequence[Cache], pool: KVPool | None = None) -> set[int]:
            if pool is None:  # a chunk's: the pool its caches are a row of, if any
                pool = caches[0].pool if seated(caches) else None  # type: ignore[attr-defined]
            read = {id(pool)} if pool is not None else set()
            waiting = [x for i in read for x in reading.pop(i, [])]
            if waiting:
                mx.eval(waiting)
            return read

        parts: list[mx.array] = []
        for group, fed in zip(groups, tokens):
            read = before(group.caches, group.pool)
            with select(self.model, [(s, 1) for s in group.rows], rows=True):
                parts.append(self.model.last_logits(fed[:, None], group.caches))  # (B,) -> (B, 1) in
            for i in read:
                reading.setdefault(i, []).append(parts[-1])
        chunk_logits: list[mx.array | None] = []
        for chunk in chunks:
            read = before(chunk.cache)
            chunk_logits.append(self._alone(chunk))  # a chunk wanting no logits is evaluated
            for i in read if chunk_logits[-1] is not None else ():
                reading.setdefault(i, []).append(chunk_logits[-1])  # type: ignore[arg-type]
        return parts, chunk_logits

    def _groups(self, sequences: Sequence[Decoding]) -> list[StepGroup]:
        """The decoding sequences by the pool rows they step in (each pool's layouts prepared),
        then each speculating one on its row alone (a segment of its own: native MTP reads the
        hidden states of the forwards over its caches). A row whose storage turns quantized at
        this token moves to the quantized pool first (``_cross``)."""
        for sequence in sequences:
            self._cross(sequence.cache)
        alone = [s for s in sequences if s.speculator is not None]
        groups: list[StepGroup] = []
        for pool in self.pools.values():  # the rows decoding this step (the others prefill in theirs, or are free)
            where = {id(row): i for i, row in enumerate(pool.layout.rows)}
            members = sorted((where[id(s.cache[0].row)], s) for s in sequences  # type: ignore[attr-defined]
                             if s.speculator is None and s.cache[0].pool is pool)  # type: ignore[attr-defined]
            if members:
                indices, rows = zip(*members)
                groups.append(StepGroup(pool.step_caches(list(indices)), list(rows), pool))  # type: ignore[arg-type]
        groups += [StepGroup(sequence.cache, [sequence], None) for sequence in alone]
        return groups

    def _cross(self, cache: list[Cache]) -> None:
        """If ``cache`` is a row whose storage turns quantized at its next token
        (``quantized_kv_start``), move it to a row of the quantized pool: its float row
        re-encoded there (``Held.quantized``: a ring row's window; its states, if any, written
        beside), nothing else copied, and the float row freed. The list is updated in place (the
        sequence and a step's chunks hold it)."""
        if seated(cache) and row_quantizes_next(cache[0].row):  # type: ignore[attr-defined]
            old: RowPlace = cache[0]  # type: ignore[assignment]
            held: list[Held | None] = [c.held().quantized() for c in cache]
            cache[:] = self._seat_in(held, old.row.rewinds)
            self._leave(old)

    def _crosses_within(self, chunks: Sequence[TokenRun]) -> bool:
        """Whether a seated prompt's storage turns quantized at a later one of its chunks in this
        step (its row moves between them: they run one after the other, ``prefill``)."""
        fed: dict[int, int] = {}
        for chunk in chunks:
            if seated(chunk.cache):
                ahead = fed.get(id(chunk.cache), 0)
                if ahead and row_quantizes_next(chunk.cache[0].row, ahead):  # type: ignore[attr-defined]
                    return True
                fed[id(chunk.cache)] = ahead + len(chunk.tokens)
        return False

    @staticmethod
    def _tokens(groups: list[StepGroup], order: list[int], inputs: mx.array | None) -> list[mx.array]:
        """Each group's input tokens ``(rows,)``: taken from ``inputs`` (its rows' at their places
        ``order`` in the step's sequences), or the rows' last tokens."""
        if inputs is None:
            return [mx.array([s.last_token for s in group.rows]) for group in groups]
        out, start = [], 0
        for group in groups:
            index = order[start : start + len(group.rows)]  # every batched row decodes in the step
            out.append(inputs if index == list(range(inputs.shape[0])) else inputs[mx.array(index)])
            start += len(group.rows)
        return out

    def _packed(
        self, groups: list[StepGroup], tokens: list[mx.array],
        chunks: Sequence[TokenRun],
    ) -> tuple[list[mx.array], list[mx.array | None]]:
        """``step``'s one forward: the decoding rows' tokens, then the chunks', packed on one row."""
        inputs = tokens + [mx.array(c.tokens).astype(mx.int32) for c in chunks]
        segments = [[StepSegment(g.caches[i], len(g.rows), 1) for g in groups]
                    + [StepSegment(c.cache[i], 1, len(c.tokens)) for c in chunks] for i in range(len(self.windows))]
        where = positions(segments[self.kv_layer])  # (an attention layer's: a recurrent one has no positions)
        layers = [PackedLayerCache(s, window, where, read) for s, window, read in zip(segments, self.windows, self.read)]
        decoding = sum(len(group.rows) for group in groups)
        ends = list(itertools.accumulate((len(c.tokens) for c in chunks), initial=decoding))[1:]
        # the rows whose logits are wanted: the decoding rows', each chunk's last ``wanted``
        picked = list(range(decoding)) + [i for c, end in zip(chunks, ends) for i in range(end - c.wanted, end)]
        watching = self.model.watching  # (native MTP) every row's hidden state, to hand to the watch
        # only the picked rows past the last layer's attention, as ``Model.last_logits`` does alone
        every = watching or not chunks or len(picked) == ends[-1]  # decoding rows only: all wanted
        keep = None if every or not picked else mx.array(picked)
        with select(self.model, [(s, 1) for group in groups for s in group.rows] + [(c, len(c.tokens)) for c in chunks], keep):
            hidden = self.model.hidden_states(mx.concatenate(inputs)[None], layers, keep=keep, watch=False)[0]  # (1, K, hidden) -> (K, hidden)
        watched = [hidden] if watching else []  # evaluated with the step
        if watching:
            self._observe(groups, chunks, hidden)
            if picked and len(picked) < hidden.shape[0]:
                hidden = hidden[mx.array(picked)]
        unwanted = [a for c in chunks if not c.last for layer in c.cache for a in layer.state] + watched
        if not picked:
            mx.eval(unwanted)
            return [], [None] * len(chunks)
        mx.async_eval(unwanted)
        logits = self.model.logits(hidden)  # (K, vocab)
        chunk_logits: list[mx.array | None] = []
        index = decoding
        for chunk in chunks:
            chunk_logits.append(logits[index : index + chunk.wanted] if chunk.wanted else None)
            index += chunk.wanted
        return ([logits[:decoding]] if decoding else []), chunk_logits

    def _observe(self, groups: list[StepGroup],
                 chunks: Sequence[TokenRun], hidden: mx.array) -> None:
        """Hand the packed step's hidden rows ``(T, hidden)`` (every row's) of each sequence
        stepping on its row alone (a speculating one's token, a prompt chunk, a round) to the
        model's watch, as a forward of its own over that row would (native MTP drafts
        from them)."""
        index = 0
        for group in groups:
            if group.pool is None:
                self.model.observe(hidden[None, index : index + 1], group.caches)
            index += len(group.rows)
        for chunk in chunks:
            self.model.observe(hidden[None, index : index + len(chunk.tokens)], chunk.cache)
            index += len(chunk.tokens)

    def release(self, sequence: Decoding) -> None:
        """Free ``sequence``'s row, if it has one (it ended, or is preempted: nothing is copied
        out); its ``cache`` becomes ``[]``."""
        place = sequence.cache[0] if seated(sequence.cache) else None
        if place is not None and place.pool is self.pools.get(place.pool.key):  # (not a pool ``reset`` dropped)
            self._leave(place)
        sequence.cache = []

    def _leave(self, place: RowPlace) -> None:
        """Free ``place``'s row of its pool; the pool goes with its last row."""
        place.pool.leave(place.index)
        if not len(place.pool):
            del self.pools[place.pool.key]

    def reset(self) -> None:
        """Forget every pool (after a failed step: the sequences in them have ended)."""
        self.pools.clear()

