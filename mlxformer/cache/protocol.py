"""The KV cache protocol: what the decoder needs from one layer's cache.

Every cache stores keys/values of shape ``(B, n_kv_heads, S, head_dim)`` for one layer and
knows how to attend over what it stores (``attention``, ``latent_attention``,
``expanded_attention``), and a packed step's cache hands out its parts (``segments``), so the
decoder, its mixers, the engine and the generation loop never check a concrete cache class
(``tests/test_layout.py`` holds every module outside this package to it): what differs per kind
is a method of the cache (``trim``, a per-sequence cache's ``reserve_rewind``) or a field of the
pool (``cache/batch_kind.py``'s ``StorageKind``). Only this package tells the kinds apart."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence

import mlx.core as mx

from mlxformer.models.mask import Mask

if TYPE_CHECKING:
    from mlxformer.cache.latent import Expand


class HasWindow(Protocol):
    """A decoder layer, as the caches see it."""

    @property
    def window(self) -> int | None:
        """The sliding window the layer attends with (None: the whole context)."""
        ...

    @property
    def recurrent(self) -> bool:
        """Whether the layer keeps a recurrent state (a ``StateCache``) instead of keys and values."""
        ...


class HasLayers(Protocol):
    """Anything with a sequence of decoder layers (the model)."""

    @property
    def layers(self) -> Sequence[HasWindow]: ...

    @property
    def cache_layers(self) -> Sequence[HasWindow]:
        """The layers with a cache of their own (Gemma 4's last layers read an earlier layer's)."""
        ...


class Cache(Protocol):
    """What the decoder needs from one layer's cache."""

    # Tokens processed so far (the RoPE position of the next token); a cache holding a batch of
    # sequences at different positions gives an int array ``(B,)``.
    offset: int | mx.array

    # A packed step's parts (``cache/packed.py``: each sequence's tokens with its own cache), which
    # a mixer runs one by one where it cannot mix them in one pass; None: the rows of one forward.
    segments: Sequence[Any] | None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        """Store new ``(B, n_kv, L, D)`` keys/values; return everything to attend over."""
        ...

    def attention(
        self, queries: mx.array, keys: Any, values: Any, scale: float, mask: Mask, softcap: float | None = None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        """Attend ``(B, n_heads, L, D)`` queries over what ``update_and_fetch`` returned (scores
        soft-capped as ``cap * tanh(s / cap)`` when ``softcap`` is set: Gemma 2; per-head
        ``sinks`` ``(n_heads,)`` join each softmax: gpt-oss)."""
        ...

    def latent_attention(
        self, q_latent: mx.array, q_rope: mx.array, keys: Any, values: Any, scale: float, mask: Mask
    ) -> mx.array:
        """Multi-head latent attention over what ``update_and_fetch`` returned for rope keys
        ``(B, 1, L, rope)`` and latents ``(B, 1, L, rank)`` (see ``cache.latent``): queries
        ``(B, H, L, rank)`` / ``(B, H, L, rope)`` in, ``(B, H, L, rank)`` out."""
        ...

    def expanded_attention(
        self, q_nope: mx.array, q_rope: mx.array, keys: Any, values: Any, mask: Mask, expand: "Expand"
    ) -> mx.array:
        """Multi-head latent attention in its expanded form (many queries over float storage):
        ``expand(q_nope, q_rope, k_rope, latent, mask)`` over what ``update_and_fetch`` returned
        (a ring row's chunk: piece by piece, each over the row's slots)."""
        ...

    def make_mask(self, query_len: int, window: int | None) -> Mask:
        """The mask for the next ``query_len`` queries (called before ``update_and_fetch``)."""
        ...

    @property
    def state(self) -> tuple[mx.array, ...]:
        """Arrays that, with ``meta_state``, restore this cache."""
        ...

    @property
    def meta_state(self) -> dict[str, str]:
        """String settings needed to rebuild this cache."""
        ...

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens; returns how many were forgotten."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache buffers."""
        ...
