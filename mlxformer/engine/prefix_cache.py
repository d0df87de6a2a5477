"""The prompt (prefix) cache: token blocks of finished sequences' caches, in memory within a
byte budget (least recently used first out), optionally backed by a disk tier.

Blocks are keyed by a hash chain (``cache.blocks``): ``lookup(prompt)`` walks the prompt's
blocks while they are cached, in memory or on disk, and rebuilds caches holding them (at least
one prompt token is left to compute). Where the chain ends, the hit goes on into the cached
block after it that shares tokens with the prompt (a full block of a conversation that went
another way, or the partial tail block a finished sequence leaves) and serves the longest hit,
so a hit covers the exact common prefix, as mlx-lm's prompt cache does (a model with sliding
windows: up to where each window's last tokens are held, ``cache.blocks``). Each block is
stored once, whatever number of sequences share it. With a ``DiskBlockStore``, every block inserted is also written to disk in the
background, and a block evicted from memory is still found there (after a restart too); tail
blocks live in memory only.

A hybrid model's hit must end where a block carries a state snapshot (``cache.blocks``): the
blocks where a sequence's cache ended when it was inserted (the engine inserts a hybrid
prompt's blocks after every prefill chunk, and the whole sequence when it ends). A block that
gets its snapshot after it was cached without one is cut again; the disk tier writes a
snapshot beside its block's file.

For the engine's memory budget: ``nbytes`` is what the memory tier holds, ``evict_to(limit)``
drops blocks until it holds at most ``limit`` bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Sequence

from mlxformer.cache import CacheSettings, new_held
from mlxformer.cache.batch_kind import Held
from mlxformer.cache.protocol import HasLayers
from mlxformer.cache.blocks import Block, assemble, block_keys, cut_blocks, head_of, tail_key, window_blocks
from mlxformer.speculative.speculator import common_prefix_length

if TYPE_CHECKING:
    from mlxformer.engine.disk_cache import DiskBlockStore

BLOCK_SIZE = 32  # tokens per block


class PrefixCache:
    """Blocks of finished sequences' caches: see the module docstring."""

    def __init__(
        self, budget: int, model: HasLayers, settings: CacheSettings | None = None, *,
        seed: str = "", block_size: int = BLOCK_SIZE, disk: "DiskBlockStore | None" = None,
    ) -> None:
        self.budget, self.model, self.settings = budget, model, settings or CacheSettings()
        self.seed, self.block_size, self.disk = seed, block_size, disk
        self.blocks: OrderedDict[str, Block] = OrderedDict()  # least recently used first
        self._parent: dict[str, str] = {}  # block key -> the key of the block before it ("" first)
        self._children: dict[str, set[str]] = {}  # the inverse: the blocks cached after a key
        self.nbytes = 0
        self.disk_tokens = 0  # prompt tokens served from the disk tier so far
        storage = [h.storage for h in new_held(model, self.settings)]
        self.hybrid = any(s.recurrent for s in storage)
        # each cache's sliding window (a rotating cache without sinks: its capacity, slack included), else None
        self.windows = [s.capacity if s.rotating and not s.keep else None for s in storage]

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def caching(self) -> bool:
        """Whether any tier keeps blocks."""
        return self.budget > 0 or self.disk is not None

    def keys_for(self, tokens: Sequence[int], count: int | None = None, salt: str = "") -> list[str]:
        """The chain keys of the full blocks of ``tokens``; ``salt`` names what else the keys
        and values depend on (the adapters a request runs with: ``adapters.cache_salt``), and
        is the chain's root ("": the base model's)."""
        return block_keys(self.seed + salt, tokens, self.block_size, count)

    def hittable(self, tokens: int) -> int:
        """Whole blocks a lookup of ``tokens`` tokens can hit: its last token is always computed
        (its logits choose the next)."""
        return (tokens - 1) // self.block_size

    def insert(self, tokens: Sequence[int], held: Sequence[Held], salt: str = "",
               keys: Sequence[str] | None = None) -> list[Block]:
        """Keep the blocks of what a sequence's layers hold (``held``: exactly ``tokens``) not kept yet: the full
        ones, and the partial one at the end in memory; returns the blocks cut (lazy). ``keys``:
        the chain keys of ``tokens``' full blocks when known (a prompt published chunk by chunk
        is hashed once, not again after every chunk)."""
        if not self.caching or not held or not tokens:
            return []
        keys = list(keys) if keys is not None else self.keys_for(tokens, salt=salt)
        size, parents = self.block_size, [salt, *keys]
        if self.hybrid and keys and len(tokens) == len(keys) * size and keys[-1] in self.blocks \
                and self.blocks[keys[-1]].states is None:  # the cached last block gets the state snapshot
            self._drop(keys[-1])
        spans = [(k, i * size, (i + 1) * size) for i, k in enumerate(keys) if k not in self.blocks]
        tail = len(tokens) - len(keys) * size
        tail_id = tail_key(parents[-1], tokens[len(tokens) - tail :]) if tail and self.budget > 0 else None
        if tail_id is not None and tail_id not in self.blocks:
            spans.append((tail_id, len(tokens) - tail, len(tokens)))
        fresh = {block.key: block for block in cut_blocks(held, tokens, spans)} if spans else {}
        if self.disk is not None:  # whole blocks (a window's evicted tokens stay out of the disk tier)
            for key in keys:
                whole = key in fresh and all(w is None or fresh[key].tokens_held(layer) == size
                                             for layer, w in enumerate(self.windows))
                if whole:
                    self.disk.put(fresh[key])
        if tail_id in fresh:
            self._add(fresh[tail_id], parents[-1])  # least recent: a tail goes before its chain
        self._touch(keys)
        for i in reversed(range(len(keys))):  # the first blocks end most recent: tails go first
            if keys[i] in fresh:
                self._add(fresh[keys[i]], parents[i])
        self.evict_to(self.budget)
        return list(fresh.values())

    def _add(self, block: Block, parent: str) -> None:
        if block.key in self.blocks or block.nbytes > self.budget:
            return
        self.blocks[block.key] = block
        self.nbytes += block.nbytes
        self._parent[block.key] = parent
        self._children.setdefault(parent, set()).add(block.key)

    def _touch(self, keys: Sequence[str]) -> None:
        """Make the cached blocks of ``keys`` the most recent, the chain's first block most of all."""
        for key in reversed(keys):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def _drop(self, key: str) -> None:
        """Drop block ``key`` from memory and from the child index (an empty child set goes too)."""
        self.nbytes -= self.blocks.pop(key).nbytes
        parent = self._parent.pop(key)
        self._children[parent].discard(key)
        if not self._children[parent]:
            del self._children[parent]

    def evict_to(self, limit: int) -> None:
        """Drop least recently used blocks until at most ``limit`` bytes are held (blocks on disk
        stay there)."""
        while self.blocks and self.nbytes > limit:
            self._drop(next(iter(self.blocks)))

    def cached_blocks(self, keys: Sequence[str]) -> int:
        """How many of the leading ``keys`` are cached, in memory or on disk."""
        return next((n for n, key in enumerate(keys)
                     if key not in self.blocks and (self.disk is None or key not in self.disk)), len(keys))

    def lookup(self, prompt: Sequence[int], salt: str = "") -> tuple[list[Held], int] | None:
        """``(held, n)``: what each layer holds once it holds the first ``n`` tokens of ``prompt``
        (its longest cached prefix, less than the prompt's length; a row seats it), or None."""
        run: list[Block] = []
        from_disk: set[str] = set()
        keys = self.keys_for(prompt, self.hittable(len(prompt)), salt)
        parents = [salt, *keys]  # parents[i]: the key of the block before block i
        for key in keys:
            start = len(run) * self.block_size
            block = self.blocks.get(key)
            if block is None and self.disk is not None:
                block = self.disk.get(key, tuple(prompt[start : start + self.block_size]))
                from_disk.add(key)
            if block is None or (run and block.storage != run[0].storage):
                break
            if key in from_disk:
                self._add(block, parents[len(run)])
            run.append(block)
        run = self._served(run, self._next_blocks(parents[len(run)], prompt, len(run) * self.block_size,
                                                  run[0].storage if run else None))
        if not run or (run[0].centers is not None and _length(run) < self.settings.quantized_kv_start):
            return None  # quantized below quantized_kv_start: a cold prefill holds those tokens as floats
        self._touch([b.key for b in run])
        self.evict_to(self.budget)
        self.disk_tokens += sum(len(b.tokens) for b in run if b.key in from_disk)
        return assemble(self.model, self.settings, run), _length(run)

    def _snapshot_from_disk(self, block: Block) -> bool:
        """Give a whole block its state snapshot from the disk tier, if one is there."""
        if self.disk is None or len(block.tokens) != self.block_size:
            return False
        states = self.disk.snapshot(block.key)
        if states is None:
            return False
        before = block.nbytes
        block.states = states
        if self.blocks.get(block.key) is block:  # the memory tier's bytes grow by the snapshot's
            self.nbytes += block.nbytes - before
        return True

    def _served(self, run: list[Block], nexts: Sequence[Block]) -> list[Block]:
        """The longest run that serves a hit: ``run`` followed by one of ``nexts`` (or none),
        ending where a hybrid model's state snapshot is and where every sliding window holds its
        last tokens (whole blocks go)."""
        best: list[Block] = []
        for candidate in [*nexts, None]:  # most tokens first: stop once none can serve more
            served = run + [candidate] if candidate is not None else list(run)
            if _length(served) <= _length(best):
                break
            while self.hybrid and served and served[-1].states is None and not self._snapshot_from_disk(served[-1]):
                served.pop()  # end where a state snapshot is
            served = served[: window_blocks(served, self.windows)]
            if _length(served) > _length(best):
                best = served
        return best

    def _next_blocks(self, parent: str, prompt: Sequence[int], start: int, storage: str | None) -> list[Block]:
        """The heads of the memory blocks after ``parent`` sharing tokens with ``prompt[start:]``
        (at least one prompt token left over), most shared first (a whole one first on a tie: it
        keeps its snapshot)."""
        room = len(prompt) - 1 - start
        found: list[tuple[int, bool, Block]] = []
        for key in self._children.get(parent, ()):
            block = self.blocks[key]
            if storage is not None and block.storage != storage:
                continue
            n = common_prefix_length(prompt[start : start + room], block.tokens)
            if n:
                found.append((n, n == len(block.tokens), block))
        found.sort(key=lambda f: (f[0], f[1]), reverse=True)
        return [head_of(block, n) for n, _, block in found]

    def flush(self) -> None:
        """Wait for the disk tier's pending writes."""
        if self.disk is not None:
            self.disk.flush()


def _length(run: Sequence[Block]) -> int:
    """Tokens of a run of blocks."""
    return sum(len(b.tokens) for b in run)
