"""The prompt cache's disk tier: one safetensors file per prefix block, written in the background.

A file ``<key>.safetensors`` holds one block's keys/values of every layer and, as metadata, the
fingerprint of the model and tokenizer that made it (``cache.files.fingerprint``), the cache
settings and the block's key and storage tag; its tokens are an array beside the layers'. Files
are written by one background thread (never on the engine's step), to a temporary name and
renamed into place, so a write killed half-way leaves no file under a block's name (the
temporary, a dot-file, is removed at the next start). A file is checked before use — metadata, tokens, every
array's count, shape and dtype (``cache.file_checks``), and that its data reads — and a file that
fails (truncated, corrupt, another model's) is removed and never used. The directory is bounded
by ``max_bytes``, least recently used files first out (the order survives restarts as mtimes).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx

from mlxformer.cache.file_checks import check_layer
from mlxformer.engine.prefix_blocks import Block
from mlxformer.errors import MlxformerError

FORMAT = "mlxformer-prefix-block"
VERSION = "1"
SUFFIX = ".safetensors"
log = logging.getLogger(__name__)


class DiskBlockStore:
    """Prefix blocks on disk under ``directory``, at most ``max_bytes`` of files.

    ``identity`` (string metadata: the fingerprint, cache settings, block size) must match a
    file's for it to be used; ``args`` (the model's ``ModelArgs``) and ``dtype`` (the KV cache's
    float dtype) give the shapes and dtypes a block's arrays must have."""

    def __init__(self, directory: str | Path, max_bytes: int, identity: dict[str, str], args: Any,
                 dtype: mx.Dtype, block_size: int) -> None:
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise MlxformerError(f"cannot use the prompt cache directory {directory}: {exc.strerror}") from None
        self.max_bytes, self.identity, self.dtype, self.block_size = max_bytes, dict(identity), dtype, block_size
        self.n_layers = args.num_hidden_layers - args.num_kv_shared_layers  # the layers with caches of their own
        self._args = SimpleNamespace(cache_dims=args.cache_dims, layer_window=lambda index: None)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, least recently used first
        self._pending: set[str] = set()
        self._scan()
        self._queue: queue.Queue[Any] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="mlxformer-prompt-cache-writer", daemon=True)
        self._writer.start()

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

    @property
    def nbytes(self) -> int:
        """Bytes of block files on disk."""
        with self._lock:
            return sum(self._index.values())

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._index or key in self._pending

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def _forget(self, key: str) -> None:
        with self._lock:
            self._index.pop(key, None)
        self._path(key).unlink(missing_ok=True)

    # --- writing (background) ----------------------------------------------------------------

    def put(self, block: Block) -> None:
        """Queue ``block`` (its arrays evaluated) to be written, unless it is on disk already."""
        with self._lock:
            if block.key in self._index or block.key in self._pending or self.max_bytes <= 0:
                return
            self._pending.add(block.key)
        self._queue.put(block)

    def _write_loop(self) -> None:
        while (block := self._queue.get()) is not None:
            if isinstance(block, _Marker):
                block.done.set()
                continue
            try:
                self._write(block)
            except Exception as exc:  # a full disk must not stop serving
                log.warning("prompt cache: cannot write block %s: %s", block.key[:12], exc)
            finally:
                with self._lock:
                    self._pending.discard(block.key)
        mx.clear_streams()

    def _write(self, block: Block) -> None:
        arrays = {"tokens": mx.array(block.tokens, dtype=mx.int32)}
        for layer in range(self.n_layers):
            state = list(block.keys[layer]) + list(block.values[layer])
            if block.centers is not None:
                state.append(block.centers[layer])
            arrays.update({f"layer.{layer}.{j}": a for j, a in enumerate(state)})
        metadata = {"format": FORMAT, "version": VERSION, **self.identity, "key": block.key, "storage": block.storage}
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{block.key}.", suffix=SUFFIX)
        os.close(fd)
        try:
            mx.save_safetensors(tmp, arrays, metadata)
            os.replace(tmp, self._path(block.key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        size = self._path(block.key).stat().st_size
        with self._lock:
            self._index[block.key] = size
            self._index.move_to_end(block.key)
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
        self._queue.put(_Marker(done))
        done.wait()

    def close(self) -> None:
        """Write what is queued, then stop the writer thread."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()

    # --- reading -------------------------------------------------------------------------------

    def get(self, key: str, tokens: tuple[int, ...]) -> Block | None:
        """The block ``key`` (holding ``tokens``) if its file is there and sound; a file that is
        not is removed."""
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self._path(key)
        try:
            block = self._read(path, key, tokens)
        except Exception as exc:
            log.warning("prompt cache: removing %s: %s", path.name, exc)
            self._forget(key)
            return None
        try:
            os.utime(path)  # the LRU order survives a restart
        except OSError:
            pass
        return block

    def _read(self, path: Path, key: str, tokens: tuple[int, ...]) -> Block:
        arrays, metadata = mx.load(str(path), format="safetensors", return_metadata=True)
        expected = {"format": FORMAT, "version": VERSION, **self.identity, "key": key}
        for name, value in expected.items():
            if metadata.get(name) != value:
                raise ValueError(f"{name} does not match (made by another model, settings or version)")
        storage = metadata.get("storage", "")
        quantized = storage != "float"
        per_pack = 3 if quantized else 1
        stored = arrays.get("tokens")
        if stored is None or stored.dtype != mx.int32 or tuple(stored.shape) != (self.block_size,):
            raise ValueError("no token array of the block size")
        count = 2 * per_pack + int(quantized)
        if len(arrays) != 1 + self.n_layers * count:
            raise ValueError(f"{len(arrays)} arrays, expected {1 + self.n_layers * count}")
        bits, group = _storage_settings(storage)
        meta = {"bits": str(bits or ""), "group_size": str(group), "start": "0", "quantized": str(int(quantized))}
        layers = []
        for layer in range(self.n_layers):
            state = [arrays[f"layer.{layer}.{j}"] for j in range(count)]
            check_layer(path, layer, "KVCache", meta, state, self._args, self.block_size)
            if any(mx.issubdtype(a.dtype, mx.floating) and a.dtype != self.dtype for a in state):
                raise ValueError(f"layer {layer} is not {self.dtype}")
            layers.append(state)
        mx.eval(list(arrays.values()))  # a truncated file fails here, not in a decode step
        if tuple(stored.tolist()) != tuple(tokens):
            raise ValueError("its tokens are not the block's")
        return Block(
            key, tuple(tokens), storage,
            [tuple(s[:per_pack]) for s in layers], [tuple(s[per_pack : 2 * per_pack]) for s in layers],
            [s[-1] for s in layers] if quantized else None,
        )


class _Marker:
    """A queue item that only signals that everything before it was written."""

    def __init__(self, done: threading.Event) -> None:
        self.done = done


def _storage_settings(storage: str) -> tuple[int | None, int]:
    """(bits, group size) of a storage tag (``float`` or ``q{bits}g{group}:{digest}``)."""
    if storage == "float":
        return None, 64
    try:
        bits, group = storage.split(":", 1)[0][1:].split("g")
        return int(bits), int(group)
    except ValueError:
        raise ValueError(f"unknown storage {storage!r}") from None


def identity_json(settings: Any) -> str:
    """Cache settings as canonical JSON (a dataclass's fields)."""
    return json.dumps(settings, sort_keys=True, default=lambda o: o.__dict__)
