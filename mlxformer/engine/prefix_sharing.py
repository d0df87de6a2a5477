"""Shared prefixes between running requests: a newcomer whose prompt shares blocks with a prompt
being prefilled waits for those blocks instead of computing them again.

While anyone waits, the prefilling sequence publishes its finished blocks to the prefix cache
after every chunk; the waiter is given its cache (a prefix-cache hit) once every block it
shares is cached, or once the other prompt is done (a prefix that cannot be cached, such as a
rotating cache past its window, is then computed as before). A waiter only ever waits for a
sequence that already has its cache, so waits never form a cycle.

A hybrid model publishes after every chunk whoever waits: a recurrent layer's state is known
only where its cache is, so each chunk's end is the one chance to keep a snapshot there (the
engine cuts such prompts at multiples of the chunk size, so those are block boundaries when the
chunk size is a multiple of the block size). A later prompt that leaves the cached one inside it
then resumes from the last snapshot before that point instead of prefilling again. A model
with sliding-window layers publishes after every chunk too: a block's keys/values in a window
layer can be cut only while the window still holds them (``cache.blocks``).
"""

from __future__ import annotations

import os
from typing import Sequence

from mlxformer.engine.prefix_cache import PrefixCache
from mlxformer.engine.request_state import RequestState, Status


class PrefixSharing:
    """The newcomers held back, and when each may go."""

    def __init__(self, prefix_cache: PrefixCache, enabled: bool = True) -> None:
        self.prefix_cache = prefix_cache
        self.enabled = enabled and prefix_cache.caching
        self.waiting: list[RequestState] = []  # newly admitted sequences, until ``ready`` lets them go
        self._keys: dict[int, list[str]] = {}

    def keys(self, sequence: RequestState) -> list[str]:
        """The block keys of the sequence's prompt (computed once)."""
        if id(sequence) not in self._keys:
            self._keys[id(sequence)] = self.prefix_cache.keys_for(sequence.prompt, salt=sequence.cache_salt)
        return self._keys[id(sequence)]

    def ready(self, prefilling: Sequence[RequestState]) -> list[RequestState]:
        """The held sequences that may get their caches now (in admission order); the finished
        (cancelled) ones are dropped."""
        live = {id(s) for s in self.waiting} | {id(s) for s in prefilling}
        self._keys = {k: v for k, v in self._keys.items() if k in live}
        going: list[RequestState] = []
        for sequence in list(self.waiting):
            if sequence.status is Status.FINISHED or not self._waits(sequence, prefilling, going):
                self.waiting.remove(sequence)
                if sequence.status is not Status.FINISHED:
                    going.append(sequence)
        return going

    def _waits(self, sequence: RequestState, prefilling: Sequence[RequestState], going: Sequence[RequestState]) -> bool:
        """Whether a prompt being prefilled (or about to be: ``going``) holds blocks of
        ``sequence``'s prompt that are not cached yet."""
        if not self.enabled:
            return False
        mine = self.keys(sequence)[: self.prefix_cache.hittable(len(sequence.prompt))]
        cached = self.prefix_cache.cached_blocks(mine)
        others = [s for s in prefilling if s.cache and s not in self.waiting] + list(going)
        # blocks shared, not cached
        return any(len(os.path.commonprefix([mine, self.keys(other)])) > cached for other in others)

    def publish(self, sequence: RequestState) -> None:
        """Offer the sequence's finished prompt blocks while others wait for them (a hybrid
        model's always: with the state snapshot where its cache ends)."""
        snapshots = self.prefix_cache.hybrid or any(self.prefix_cache.windows)  # states, windows: cut per chunk
        wanted = self.waiting or (snapshots and self.prefix_cache.caching)
        if wanted and sequence.processed >= self.prefix_cache.block_size:
            full = sequence.processed // self.prefix_cache.block_size
            self.prefix_cache.insert(sequence.prompt[: sequence.processed], [c.held() for c in sequence.cache], sequence.cache_salt,
                                     self.keys(sequence)[:full])
