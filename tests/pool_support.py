"""What a sequence's layers hold (``Held``), given by its caches, and caches to decode on from
what a prefix-cache hit holds: seated in a row of a pool of its own, as the engine seats a hit
(``BatchRunner.seat``)."""

from __future__ import annotations

from typing import Any, Sequence

from mlxformer.cache.batch_kind import Held
from mlxformer.engine.batch_runner import BatchRunner


class Seated:
    """What ``BatchRunner.seat`` needs of a sequence."""

    speculator = None
    adapters = None
    cache: list = []


def held(caches: Sequence[Any]) -> list[Held]:
    """What each of ``caches`` holds."""
    return [c.held() for c in caches]


def seated(model: Any, layers: list[Held], chunk: int | None = None) -> list:
    """Caches holding ``layers``: the views of a row of a pool of their own (``chunk``: the
    prompt chunk a rotating row keeps slots for)."""
    runner = BatchRunner(model)
    runner.prefill_chunk = chunk
    sequence = Seated()
    runner.seat(sequence, list(layers))  # type: ignore[arg-type]
    return sequence.cache
