"""Shared prefixes between running requests: a newcomer whose prompt shares blocks with a prompt
being prefilled waits for those blocks instead of computing them again.

While anyone waits, the prefilling sequence publishes its finished blocks to the prefix cache
after every chunk; the waiter is given its cache (a prefix-cache hit) once every block it
shares is cached, or once the other prompt is done (a prefix that cannot be cached, such as a
rotating cache past its window, is then computed as before). A waiter only ever waits for a
sequence that already has its cache, so waits never form a cycle.
"""

from __future__ import annotations

import os
from typing import Sequence as Seq

from mlxformer.engine.prefix_cache import PrefixCache
from mlxformer.engine.sequence import Sequence, Status


class PrefixSharing:
    """The newcomers held back, and when each may go."""

    def __init__(self, prefix_cache: PrefixCache, enabled: bool = True) -> None:
        self.prefix_cache = prefix_cache
        self.enabled = enabled and (prefix_cache.budget > 0 or prefix_cache.disk is not None)
        self.held: list[Sequence] = []
        self._keys: dict[int, list[str]] = {}

    def keys(self, sequence: Sequence) -> list[str]:
        """The block keys of the sequence's prompt (computed once)."""
        if id(sequence) not in self._keys:
            self._keys[id(sequence)] = self.prefix_cache.keys_for(sequence.prompt)
        return self._keys[id(sequence)]

    def hold(self, sequence: Sequence) -> None:
        """Hold a newly admitted sequence until ``ready`` lets it go."""
        self.held.append(sequence)

    def ready(self, prefilling: Seq[Sequence]) -> list[Sequence]:
        """The held sequences that may get their caches now (in admission order); the finished
        (cancelled) ones are dropped."""
        live = {id(s) for s in self.held} | {id(s) for s in prefilling}
        self._keys = {k: v for k, v in self._keys.items() if k in live}
        going: list[Sequence] = []
        for sequence in list(self.held):
            if sequence.status is Status.FINISHED or not self._waits(sequence, prefilling, going):
                self.held.remove(sequence)
                if sequence.status is not Status.FINISHED:
                    going.append(sequence)
        return going

    def _waits(self, sequence: Sequence, prefilling: Seq[Sequence], going: Seq[Sequence]) -> bool:
        """Whether a prompt being prefilled (or about to be: ``going``) holds blocks of
        ``sequence``'s prompt that are not cached yet."""
        if not self.enabled:
            return False
        mine = self.keys(sequence)[: (len(sequence.prompt) - 1) // self.prefix_cache.block_size]
        cached = self.prefix_cache.cached_blocks(mine)
        others = [s for s in prefilling if s.cache and s not in self.held] + list(going)
        for other in others:
            if len(os.path.commonprefix([mine, self.keys(other)])) > cached:  # blocks shared, not cached
                return True
        return False

    def publish(self, sequence: Sequence) -> None:
        """Offer the sequence's finished prompt blocks while others wait for them."""
        if self.held and sequence.processed >= self.prefix_cache.block_size:
            self.prefix_cache.insert(sequence.prompt[: sequence.processed], sequence.cache)
