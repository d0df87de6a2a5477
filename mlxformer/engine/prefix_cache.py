"""Prefix reuse: finished sequences' KV caches, looked up by the longest shared token prefix,
bounded by a byte budget with least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from mlxformer.cache import Cache


def copy_cache(cache: Cache) -> Cache:
    """A new cache object with the same contents (MLX arrays are immutable: buffers are shared
    until one side writes, which then copies)."""
    clone: Cache = type(cache)()
    clone.meta_state = cache.meta_state  # type: ignore[misc]
    clone.state = cache.state  # type: ignore[misc]
    return clone


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    """Per-layer caches of finished sequences keyed by the tokens they hold.

    ``lookup(prompt)`` returns a copy of the entry sharing the longest prefix with ``prompt``,
    trimmed to that prefix (leaving at least one prompt token to compute the next logits from).
    Entries count their caches' ``nbytes`` against ``budget``; the least recently used go first.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.entries: OrderedDict[tuple[int, ...], tuple[list[Cache], int]] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    def insert(self, tokens: Sequence[int], caches: list[Cache]) -> None:
        """Keep ``caches`` (holding exactly ``tokens``), replacing entries it extends."""
        key = tuple(tokens)
        if not key or self.budget <= 0:
            return
        size = sum(c.nbytes for c in caches)
        if size > self.budget:
            return
        for other in [k for k in self.entries if len(k) <= len(key) and key[: len(k)] == k]:
            self._remove(other)
        self.entries[key] = (caches, size)
        self.nbytes += size
        while self.nbytes > self.budget:
            self._remove(next(iter(self.entries)))

    def evict_to(self, nbytes: int) -> int:
        """Evict least recently used entries until at most ``nbytes`` are held; returns the bytes held.

        The engine's KV budget calls this: ``nbytes`` and ``evict_to`` are the whole interface it uses."""
        while self.entries and self.nbytes > max(nbytes, 0):
            self._remove(next(iter(self.entries)))
        return self.nbytes

    def _remove(self, key: tuple[int, ...]) -> None:
        _, size = self.entries.pop(key)
        self.nbytes -= size

    def lookup(self, prompt: Sequence[int]) -> tuple[list[Cache], int] | None:
        """``(caches, n)``: new caches holding the first ``n`` tokens of ``prompt``, or None."""
        best, best_len = None, 0
        for key in self.entries:
            n = min(common_prefix(key, prompt), len(prompt) - 1)
            if n > best_len:
                best, best_len = key, n
        if best is None:
            return None
        self.entries.move_to_end(best)
        caches, _ = self.entries[best]
        copies = [copy_cache(c) for c in caches]
        excess = len(best) - best_len
        if excess and any(c.trim(excess) != excess for c in copies):
            return None  # e.g. a rotating cache that already evicted tokens
        return copies, best_len
