"""Prefix blocks: a cache cut into fixed-size token blocks, keyed by a hash chain (vLLM's
prefix caching), and caches rebuilt from a run of blocks.

Block ``i`` of a token list is keyed by ``sha256(key of block i-1, its tokens)``, the chain
starting from a seed that names the model and cache settings: a key says which tokens the block
holds *and* everything before them, so two prompts that share a system prompt share its blocks,
and a hit can be partial. A block holds every layer's keys/values of its tokens (copies, so it
owns exactly the bytes it counts), tagged with its storage (float, or the quantization and the
digest of the sequence's key centers): a run of blocks is used only while the tags agree.

A hybrid model's recurrent layers hold no per-token arrays: their packs are
empty, and the block that ends where the sequence's cache ended carries a snapshot of every
recurrent layer's state there (``states``). A hit on a hybrid model ends at a block with a
snapshot, taken whole (the state after any other prefix is not known); the engine inserts a
hybrid prompt after each prefill chunk, so its chunk ends have snapshots too.

A sliding-window layer (a rotating cache without sinks: Gemma's, Mistral's, gpt-oss's local
layers) only ever sees its last ``capacity`` tokens, and that is all a cold prefill leaves in
its cache: a block holds that layer's keys/values for the last tokens of the block the window
still held when the block was cut (all of them, some, or none: ``Block.held``). A run of ``n``
tokens serves when each window layer holds the run's last ``capacity`` tokens (``window_blocks``
finds the longest such head of a run: whole blocks, since the tokens a layer holds end at a
block's end); the cache is rebuilt with those tokens in time order, as a cold prefill leaves it
after a chunk. The engine
inserts such prompts after every prefill chunk, so a block is cut while the window still holds
its tokens, and the window's last ``capacity`` tokens at every chunk's end are kept (llama.cpp's
SWA checkpoints, at the block boundaries the hash chain has anyway): a hit can always end at a
chunk's end (the end of an earlier prompt: a multi-turn conversation's next turn), and anywhere
when the chunk is at most the window less a block.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, replace
from typing import Sequence

import mlx.core as mx
import numpy as np

from mlxformer.cache import CacheSettings, new_held
from mlxformer.cache.batch_kind import Held
from mlxformer.cache.codec import FLOAT_CODEC, KVCodec, Pack
from mlxformer.cache.protocol import HasLayers


def block_keys(seed: str, tokens: Sequence[int], block_size: int, count: int | None = None) -> list[str]:
    """Hash-chain keys (hex) of the first ``count`` full blocks of ``tokens`` (all by default)."""
    full = len(tokens) // block_size if count is None else min(count, len(tokens) // block_size)
    keys, parent = [], seed.encode()
    for i in range(full):
        block = np.asarray(tokens[i * block_size : (i + 1) * block_size], dtype=np.int64).tobytes()
        parent = hashlib.sha256(parent + block).digest()
        keys.append(parent.hex())
    return keys


@dataclass
class Block:
    """One block's keys/values in every layer: ``keys[l]``/``values[l]`` packs ``(1, n_kv, block, ...)``."""

    key: str
    tokens: tuple[int, ...]
    storage: str  # "float", or "q{bits}g{group}:{digest of the key centers}"
    keys: list[Pack]
    values: list[Pack]
    centers: list[mx.array] | None  # each layer's key center (1, n_kv, 1, D) when quantized
    # each layer's window and state (``Held.state``) after the block's last token (``()`` for an attention
    # layer); None: no snapshot (a hybrid model's run cannot end here)
    states: list[tuple[mx.array, ...]] | None = None

    def tokens_held(self, layer: int) -> int:
        """How many of the block's last tokens layer ``layer`` holds keys/values for (a window
        layer cut after its window moved past the block's first tokens holds fewer)."""
        pack = self.keys[layer]
        return int(pack[0].shape[2]) if pack else 0

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.arrays())

    def arrays(self) -> list[mx.array]:
        """Every array the block holds."""
        states = [x for state in self.states or [] for x in state]
        return [x for pack in self.keys + self.values for x in pack] + list(self.centers or []) + states


def storage_tag(held: Sequence[Held]) -> str | None:
    """The storage tag of what a sequence's layers hold, or None when it is not a plain prefix
    (a rotating cache that has evicted tokens from beside its sinks) or nothing."""
    held = [h for h in held if not h.storage.recurrent]  # the attention layers'
    if not held or not held[0].positions:
        return None
    if any(h.storage.keep and len(h.positions) != h.offset for h in held):
        return None  # sinks kept apart from an evicted middle: not a prefix
    codec = held[0].codec
    if codec.bits is None:
        return "float"
    centers = [h.codec.key_center for h in held]
    mx.eval(centers)
    digest = hashlib.sha256(b"".join(np.asarray(c.astype(mx.float32)).tobytes() for c in centers)).hexdigest()[:16]
    return f"q{codec.bits}g{codec.group_size}:{digest}"


def tail_key(parent: str, tokens: Sequence[int]) -> str:
    """The key of a partial (tail) block of ``tokens`` after the block keyed ``parent`` ("" at
    the start): apart from every full block's key, since it is never a chain's link."""
    block = np.asarray(tokens, dtype=np.int64).tobytes()
    return hashlib.sha256(b"tail:" + parent.encode() + block).hexdigest()


def cut_blocks(held: Sequence[Held], tokens: Sequence[int], spans: Sequence[tuple[str, int, int]]) -> list[Block]:
    """The blocks named by ``spans`` (key, start, end) of what a sequence's layers hold
    (``held``, of ``tokens``); their arrays are evaluated copies."""
    tag = storage_tag(held)
    if tag is None:
        return []
    blocks = []
    end = held[0].offset
    # each layer's key center when quantized (a recurrent layer's: an empty array)
    centers = [mx.zeros((0,)) if h.storage.recurrent else h.codec.key_center for h in held] if tag != "float" else None
    for key, a, b in spans:
        layer_keys = [_slice(h, h.keys, a, b) for h in held]
        layer_values = [_slice(h, h.values, a, b) for h in held]
        states = [h.state for h in held] if b == end else None
        blocks.append(Block(key, tuple(tokens[a:b]), tag, layer_keys, layer_values, centers, states))  # type: ignore[arg-type]
    mx.eval([x for block in blocks for x in block.arrays()])
    return blocks


def _slice(held: Held, pack: Pack, a: int, b: int) -> Pack:
    """Copies of a layer's keys or values (``pack``) of the tokens ``a:b`` it still holds (the
    last of them, for a window that moved past ``a``; nothing for a recurrent layer)."""
    if not held.positions:
        return ()
    first = held.positions[0]
    a, b = max(a, first) - first, b - first
    if a >= b:
        return ()
    return tuple(mx.contiguous(x[..., a:b, :]) for x in pack)


def window_blocks(blocks: Sequence[Block], windows: Sequence[int | None]) -> int:
    """The most leading blocks of the run ``blocks`` at whose end every window layer
    (``windows[l]`` its capacity, None: not a window) holds its keys/values for the last
    ``capacity`` tokens (all that a sliding window of that capacity keeps); 0 when none does.
    A block holds a layer's last tokens, so the tokens a layer holds run up to blocks' ends, and
    the longest such head of a run ends at a block's end."""
    serves = [True] * len(blocks)  # whether the run's first i + 1 blocks serve
    ends = list(itertools.accumulate(len(b.tokens) for b in blocks))
    for layer, w in enumerate(windows):
        if not w:
            continue
        first = 0  # where the tokens the layer holds without a gap up to the block's end start
        for i, (block, end) in enumerate(zip(blocks, ends)):
            held = block.tokens_held(layer)
            first = first if held == len(block.tokens) else end - held
            serves[i] = serves[i] and first <= max(0, end - w)
    return max((i + 1 for i, ok in enumerate(serves) if ok), default=0)


def head_of(block: Block, n: int) -> Block:
    """The first ``n`` tokens of ``block`` (views of its arrays: a hit takes them, the cache keeps
    the whole block). A window layer holding the block's last ``h`` tokens keeps those of them
    among the first ``n``."""
    if n == len(block.tokens):
        return block
    cut = len(block.tokens) - n  # tokens dropped from the end

    def head(packs: list[Pack]) -> list[Pack]:
        return [tuple(x[..., : max(0, x.shape[2] - cut), :] for x in pack) for pack in packs]

    return Block(block.key, block.tokens[:n], block.storage, head(block.keys), head(block.values), block.centers)  # no snapshot


def _last(x: mx.array, n: int) -> mx.array:
    """The last ``n`` tokens of ``x`` (..., T, D)."""
    return x[..., x.shape[2] - n :, :]


def assemble(model: HasLayers, settings: CacheSettings, blocks: Sequence[Block]) -> list[Held]:
    """What the layers of caches made like ``make_cache(model, settings)`` hold once they hold
    the tokens of ``blocks`` (a run with one storage tag), as a cold prefill leaves them: a
    window's last ``capacity`` tokens in time order, a recurrent layer's last snapshot."""
    centers = blocks[0].centers
    quantized = centers is not None
    n = sum(len(b.tokens) for b in blocks)
    held = []
    for layer, empty in enumerate(new_held(model, settings)):
        if empty.storage.recurrent:  # the last block's snapshot
            assert blocks[-1].states is not None
            held.append(replace(empty, offset=n, state=blocks[-1].states[layer]))
            continue
        count = n if empty.storage.capacity is None else min(n, empty.storage.capacity)
        run, have = [], 0  # the blocks holding the last ``count`` tokens (a window: its capacity)
        for block in reversed(blocks):
            if have >= count:
                break
            run.insert(0, block)
            have += len(block.tokens)
        # the run's first block may hold only its last tokens (a window's): take the last ``count``
        keys = tuple(_last(mx.concatenate(parts, axis=2), count) for parts in zip(*(b.keys[layer] for b in run)))
        values = tuple(_last(mx.concatenate(parts, axis=2), count) for parts in zip(*(b.values[layer] for b in run)))
        bits = int(empty.meta["bits"]) if quantized else None
        codec = KVCodec(bits, empty.storage.group_size, centers[layer]) if centers is not None else FLOAT_CODEC
        held.append(Held(replace(empty.storage, bits=bits), {**empty.meta, "quantized": str(int(quantized))}, n,
                         keys, values, list(range(n - count, n)), codec))
    return held
