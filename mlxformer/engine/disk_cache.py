"""The prompt cache's disk tier: one safetensors file per prefix block, written in the background.

A file ``<key>.safetensors`` holds one block's keys/values of every layer and, as metadata, the
fingerprint of the model and tokenizer that made it (``generation.prompt_cache_files.fingerprint``), the cache
settings and the block's key and storage tag; its tokens are an array beside the layers'. Files
are written by one background thread (never on the engine's step), to a temporary name and
renamed into place, so a write killed half-way leaves no file under a block's name (the
temporary, a dot-file, is removed at the next start). A file is checked before use — metadata, tokens, every
array's count, shape and dtype (``cache.file_checks``), and that its data reads — and a file that
fails (truncated, corrupt, another model's) is removed and never used. The directory is bounded
by ``max_bytes``, least recently used files first out (the order survives restarts as mtimes).

A hybrid model's block holds only its attention layers' arrays; a block with a state snapshot
(``Block.states``) gets a second file beside it, ``<key>.state.safetensors``: every recurrent
layer's conv window and state there, with the same metadata. It is written when the snapshot
first exists (a block may be on disk before it has one) and read only where a hit would end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

import mlx.core as mx

from mlxformer.cache.file_checks import check_layer
from mlxformer.cache.blocks import Block
from mlxformer.errors import MlxformerError

FORMAT = "mlxformer-prefix-block"
VERSION = "1"
SUFFIX = ".safetensors"
SNAPSHOT = ".state"  # the name of a block's snapshot file: <key>.state.safetensors
log = logging.getLogger(__name__)


class DiskBlockStore:
    """Prefix blocks on disk under ``directory``, at most ``max_bytes`` of files.

    ``identity`` (string metadata: the fingerprint, cache settings, block size) must match a
    file's for it to be used; ``args`` (the model's ``ModelArgs``) and ``dtype`` (the KV cache's
    float dtype) give the shapes and dtypes a block's arrays must have; ``recurrent`` says which
    layers are recurrent (they keep no arrays per block, only snapshots)."""

    def __init__(self, directory: str | Path, max_bytes: int, identity: dict[str, str], args: Any,
                 dtype: mx.Dtype, block_size: int, recurrent: Sequence[bool]) -> None:
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise MlxformerError(f"cannot use the prompt cache directory {directory}: {exc.strerror}") from None
        self.max_bytes, self.identity, self.dtype, self.block_size = max_bytes, dict(identity), dtype, block_size
        self.n_layers = args.num_hidden_layers - args.num_kv_shared_layers  # the layers with caches of their own
        self._kv_layers = [layer for layer in range(self.n_layers) if not recurrent[layer]]
        self._state_layers = [layer for layer in range(self.n_layers) if recurrent[layer]]
        self._args = SimpleNamespace(cache_dims=args.cache_dims, layer_window=lambda index: None)
        self._model_args = args
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, least recently used first
        self._pending: set[str] = set()
        self._scan()
        self._queue: queue.Queue[Block | threading.Event] = queue.Queue()
        threading.Thread(target=self._write_loop, name="mlxformer-prompt-cache-writer", daemon=True).start()

    # --- index ----------------------------------------------------------------------------

    def _scan(self) -> None:
        """Index the block files already there (oldest first); remove stale temporaries."""
        found = []
        for path in self.directory.iterdir():
            if path.name.startswith(".") and path.suffix == SUFFIX:  # a write that never finished
                path.unlink(missing_ok=True)
            elif path.suffix == SUFFIX and path.is_file():
                stat = path.stat()
                found.append((stat.st_mtime, path.stem, stat.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._index or key in self._pending

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    # --- writing (background) ----------------------------------------------------------------

    def put(self, block: Block) -> None:
        """Queue ``block`` (its arrays evaluated) to be written: its file unless it is on disk
        already, and its snapshot file when it has a snapshot that is not."""
        names = [block.key] + ([block.key + SNAPSHOT] if self._snapshot_of(block) else [])
        with self._lock:
            if self.max_bytes <= 0 or all(n in self._index or n in self._pending for n in names):
                return
            self._pending.update(names)
        self._queue.put(block)

    def _write_loop(self) -> None:
        while True:
            block = self._queue.get()
            if isinstance(block, threading.Event):  # ``flush``'s: everything before it is written
                block.set()
                continue
            try:
                self._write(block)
            except Exception as exc:  # a full disk must not stop serving
                log.warning("prompt cache: cannot write block %s: %s", block.key[:12], exc)
            finally:
                with self._lock:
                    self._pending.difference_update((block.key, block.key + SNAPSHOT))

    def _write(self, block: Block) -> None:
        with self._lock:
            written = block.key in self._index, block.key + SNAPSHOT in self._index
        metadata = {"format": FORMAT, "version": VERSION, **self.identity, "key": block.key, "storage": block.storage}
        if not written[0]:
            arrays = {"tokens": mx.array(block.tokens, dtype=mx.int32)}
            for layer in self._kv_layers:
                state = list(block.keys[layer]) + list(block.values[layer])
                if block.centers is not None:
                    state.append(block.centers[layer])
                arrays.update({f"layer.{layer}.{j}": a for j, a in enumerate(state)})
            self._save(block.key, arrays, metadata)
        if self._snapshot_of(block) and not written[1]:
            assert block.states is not None
            snapshot = {f"state.{layer}.{j}": a for layer in self._state_layers for j, a in enumerate(block.states[layer])}
            self._save(block.key + SNAPSHOT, snapshot, metadata)

    def _snapshot_of(self, block: Block) -> bool:
        """Whether ``block`` has a snapshot of recurrent layers to write."""
        return block.states is not None and bool(self._state_layers)

    def _save(self, name: str, arrays: dict[str, mx.array], metadata: dict[str, str]) -> None:
        """Write file ``name`` (through a temporary), then drop least recently used files over the bound."""
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{name}.", suffix=SUFFIX)
        os.close(fd)
        try:
            mx.save_safetensors(tmp, arrays, metadata)
            os.replace(tmp, self._path(name))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        size = self._path(name).stat().st_size
        with self._lock:
            self._index[name] = size
            self._index.move_to_end(name)
            victims = []
            total = sum(self._index.values())
            while total > self.max_bytes and self._index:
                key, freed = self._index.popitem(last=False)
                victims.append(key)
                total -= freed
        for key in victims:
            self._path(key).unlink(missing_ok=True)

    def flush(self) -> None:
        """Wait until every queued block is written."""
        done = threading.Event()
        self._queue.put(done)
        done.wait()

    # --- reading -------------------------------------------------------------------------------

    def get(self, key: str, tokens: tuple[int, ...]) -> Block | None:
        """The block ``key`` (holding ``tokens``; without its snapshot) if its file is there and
        sound; a file that is not is removed."""
        return self._load(key, lambda path: self._read(path, key, tokens))

    def snapshot(self, key: str) -> list[tuple[mx.array, ...]] | None:
        """The state snapshot of block ``key`` (each layer's ``StateCache.state``, ``()`` for an
        attention layer) if its file is there and sound; a file that is not is removed."""
        return self._load(key + SNAPSHOT, lambda path: self._read_snapshot(path, key))

    def _load(self, name: str, read: Any) -> Any:
        with self._lock:
            if name not in self._index:
                return None
            self._index.move_to_end(name)
        path = self._path(name)
        try:
            loaded = read(path)
        except Exception as exc:
            log.warning("prompt cache: removing %s: %s", path.name, exc)
            with self._lock:
                self._index.pop(name, None)
            path.unlink(missing_ok=True)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # the LRU order survives a restart
        return loaded

    def _open(self, path: Path, key: str) -> tuple[dict[str, mx.array], dict[str, str]]:
        """A file's arrays and metadata, refused unless the metadata names this model and block."""
        arrays, metadata = mx.load(str(path), format="safetensors", return_metadata=True)
        expected = {"format": FORMAT, "version": VERSION, **self.identity, "key": key}
        for name, value in expected.items():
            if metadata.get(name) != value:
                raise ValueError(f"{name} does not match (made by another model, settings or version)")
        return arrays, metadata

    def _read(self, path: Path, key: str, tokens: tuple[int, ...]) -> Block:
        arrays, metadata = self._open(path, key)
        storage = metadata.get("storage", "")
        quantized = storage != "float"
        per_pack = 3 if quantized else 1
        stored = arrays.get("tokens")
        if stored is None or stored.dtype != mx.int32 or tuple(stored.shape) != (self.block_size,):
            raise ValueError("no token array of the block size")
        count = 2 * per_pack + int(quantized)
        if len(arrays) != 1 + len(self._kv_layers) * count:
            raise ValueError(f"{len(arrays)} arrays, expected {1 + len(self._kv_layers) * count}")
        bits, group = _storage_settings(storage)
        meta = {"bits": str(bits or ""), "group_size": str(group), "start": "0", "quantized": str(int(quantized))}
        layers: list[list[mx.array]] = [[]] * self.n_layers  # a recurrent layer: no arrays
        for layer in self._kv_layers:
            state = [arrays[f"layer.{layer}.{j}"] for j in range(count)]
            check_layer(path, layer, "KVCache", meta, state, self._args, self.block_size)
            if any(mx.issubdtype(a.dtype, mx.floating) and a.dtype != self.dtype for a in state):
                raise ValueError(f"layer {layer} is not {self.dtype}")
            layers[layer] = state
        mx.eval(list(arrays.values()))  # a truncated file fails here, not in a decode step
        if tuple(stored.tolist()) != tuple(tokens):
            raise ValueError("its tokens are not the block's")
        no_center = mx.zeros((0,))  # a recurrent layer's (``cache.blocks``)
        return Block(
            key, tuple(tokens), storage,
            [tuple(s[:per_pack]) for s in layers], [tuple(s[per_pack : 2 * per_pack]) for s in layers],
            [s[-1] if s else no_center for s in layers] if quantized else None,
        )

    def _read_snapshot(self, path: Path, key: str) -> list[tuple[mx.array, ...]]:
        arrays, _ = self._open(path, key)
        if len(arrays) != 2 * len(self._state_layers):
            raise ValueError(f"{len(arrays)} arrays, expected {2 * len(self._state_layers)}")
        states: list[tuple[mx.array, ...]] = [()] * self.n_layers
        for layer in self._state_layers:
            state = [arrays[f"state.{layer}.{j}"] for j in range(2)]
            check_layer(path, layer, "StateCache", {"offset": "0", "keep": "1"}, state, self._model_args, 0)
            states[layer] = tuple(state)
        mx.eval(list(arrays.values()))
        return states


def _storage_settings(storage: str) -> tuple[int | None, int]:
    """(bits, group size) of a storage tag (``float`` or ``q{bits}g{group}:{digest}``)."""
    if storage == "float":
        return None, 64
    try:
        bits, group = storage.split(":", 1)[0][1:].split("g")
        return int(bits), int(group)
    except ValueError:
        raise ValueError(f"unknown storage {storage!r}") from None
