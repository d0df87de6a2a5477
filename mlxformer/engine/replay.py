"""Replaying a preempted sequence's generated tokens after its caches were recomputed, and
rolling caches back after a failed step.

``resume_tokens`` says how much of its prefix-cache copy a preempted sequence takes back: all it
had, or, when that would end inside its prompt, only up to the last boundary of its first
prefill's chunks. Its prompt is then cut into the same chunks as before, so it computes the same
keys and values bit for bit (a quantized cache would turn a rounding difference into a different
token).

A resumed sequence whose caches hold its prompt and ``generated[:index]`` feeds the rest again,
one decode step each (the same computation as when it generated them, so its caches and its
output are what they would have been without the preemption). While it replays, ``generated``
is cut after the next token to feed (the one a decode step takes, ``last_token``) and the
tokens after it wait here; their logits are not used."""

from __future__ import annotations

from mlxformer.cache import Cache
from mlxformer.cache.batch_kind import Held
from mlxformer.engine.prefix_cache import PrefixCache
from mlxformer.engine.request_state import RequestState


def resume_tokens(sequence: RequestState, prefix_cache: PrefixCache, prefill_chunk: int) -> list[int]:
    """The tokens a preempted ``sequence`` looks up in ``prefix_cache`` (see the module's doc)."""
    tokens, prompt, start = sequence.tokens, len(sequence.prompt), sequence.cached_tokens
    keys = prefix_cache.keys_for(tokens, prefix_cache.hittable(len(tokens)), sequence.cache_salt)
    hit = prefix_cache.cached_blocks(keys) * prefix_cache.block_size
    if hit >= prompt or hit <= start:
        return tokens
    boundary = start + (hit - start) // prefill_chunk * prefill_chunk
    return tokens[: boundary + 1]  # a lookup serves fewer tokens than it is given


class Replays:
    """The sequences replaying their generated tokens, and the tokens each has still to feed."""

    def __init__(self) -> None:
        self._pending: dict[int, list[int]] = {}

    def __contains__(self, sequence: RequestState) -> bool:
        return id(sequence) in self._pending

    def start(self, sequence: RequestState, index: int) -> None:
        """Replay ``generated[index:]`` (nothing when only the last token is left to feed)."""
        if index < len(sequence.generated) - 1:
            self._pending[id(sequence)] = sequence.generated[index + 1 :]
            del sequence.generated[index + 1 :]

    def advance(self, sequences: list[RequestState]) -> None:
        """After a decode step: each replaying sequence's next token is the one it had generated."""
        for sequence in sequences:
            pending = self._pending.get(id(sequence))
            if pending is not None:
                sequence.generated.append(pending.pop(0))
                if not pending:
                    del self._pending[id(sequence)]

    def stop(self, sequence: RequestState) -> None:
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


def taken_back(held: list[Held], n: int) -> list[Held]:
    """What a sequence's layers hold (``held``) without the last ``n`` tokens when every layer
    can give them back (``Held.back``), else ``held``."""
    back = [h.back(n) for h in held]
    return held if None in back else back  # type: ignore[return-value]
