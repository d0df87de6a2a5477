"""Replaying a preempted sequence's generated tokens after its caches were recomputed, and
rolling caches back after a failed step.

A resumed sequence whose caches hold its prompt and ``generated[:index]`` feeds the rest again,
one decode step each (the same computation as when it generated them, so its caches and its
output are what they would have been without the preemption). While it replays, ``generated``
is cut after the next token to feed (the one a decode step takes, ``last_token``) and the
tokens after it wait here; their logits are not used."""

from __future__ import annotations

from mlxformer.cache import Cache
from mlxformer.engine.sequence import Sequence


class Replays:
    """The sequences replaying their generated tokens, and the tokens each has still to feed."""

    def __init__(self) -> None:
        self._pending: dict[int, list[int]] = {}

    def __contains__(self, sequence: Sequence) -> bool:
        return id(sequence) in self._pending

    def start(self, sequence: Sequence, index: int) -> None:
        """Replay ``generated[index:]`` (nothing when only the last token is left to feed)."""
        if index < len(sequence.generated) - 1:
            self._pending[id(sequence)] = sequence.generated[index + 1 :]
            del sequence.generated[index + 1 :]

    def advance(self, sequences: list[Sequence]) -> None:
        """After a decode step: each replaying sequence's next token is the one it had generated."""
        for sequence in sequences:
            pending = self._pending.get(id(sequence))
            if pending is not None:
                sequence.generated.append(pending.pop(0))
                if not pending:
                    del self._pending[id(sequence)]

    def stop(self, sequence: Sequence) -> None:
        """Give a sequence all its generated tokens back (it leaves the batch)."""
        sequence.generated += self._pending.pop(id(sequence), [])

    def clear(self) -> None:
        self._pending.clear()


def rewind_caches(cache: list[Cache], offset: int) -> bool:
    """Trim each layer's cache back to ``offset`` tokens; False if one cannot be."""
    for layer in cache:
        extra = int(layer.offset) - offset
        if extra > 0 and layer.trim(extra) != extra:
            return False
    return True
