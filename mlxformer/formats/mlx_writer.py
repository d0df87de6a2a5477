"""Writing an MLX model dir: sharded safetensors, staged in a temporary sibling dir.

Output tensors are planned into shards by their (computable) sizes, and each shard is
evaluated, written and freed before the next, so peak memory stays near one shard rather
than the model size. The destination is checked before anything is written and replaced
only when the new dir is complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import mlx.core as mx
from tqdm import tqdm

from mlxformer.errors import MlxformerError
from mlxformer.formats.safetensors import INDEX_NAME

MAX_SHARD_BYTES = 5 * 1024**3


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Split ``(name, nbytes)`` pairs, in order, into shards of at most ``max_bytes`` (a bigger
    tensor gets a shard of its own)."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, size in sizes:
        if current and current_bytes + size > max_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    if current:
        shards.append(current)
    return shards


def shard_file_names(count: int) -> list[str]:
    """``model.safetensors`` for one shard, ``model-0000i-of-0000n.safetensors`` otherwise."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_shards(
    directory: Path,
    groups: list[list[str]],
    produce: Callable[[list[str]], dict[str, mx.array]],
    progress: bool = True,
) -> None:
    """Write each group of output tensors (made by ``produce``) as one safetensors file, plus
    the index when there are several; each shard is evaluated and freed before the next."""
    names = shard_file_names(len(groups))
    weight_map: dict[str, str] = {}
    total_size = 0
    bar = tqdm(total=sum(len(g) for g in groups), unit="tensor", desc="Converting", disable=not progress)
    try:
        for file_name, group in zip(names, groups):
            arrays = produce(group)
            mx.eval(arrays)
            mx.save_safetensors(str(directory / file_name), arrays, metadata={"format": "mlx"})
            for key, array in arrays.items():
                weight_map[key] = file_name
                total_size += array.nbytes
            bar.update(len(group))
            del arrays
            mx.clear_cache()
    finally:
        bar.close()
    if len(groups) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def _contains(directory: Path, path: Path) -> bool:
    """Whether ``path`` is ``directory`` or lies inside it (both resolved)."""
    return path == directory or directory in path.parents


def is_model_dir(directory: Path) -> bool:
    """A dir that ``--force`` may replace: regular files only (no subdirectories, no links),
    among them ``config.json`` and at least one ``*.safetensors`` file, as a conversion writes."""
    entries = list(directory.iterdir())
    if any(e.is_symlink() or not e.is_file() for e in entries):
        return False
    names = {e.name for e in entries}
    return "config.json" in names and any(n.endswith(".safetensors") for n in names)


def check_destination(destination: Path, source: Path, force: bool) -> None:
    """Refuse an output path that converting to ``destination`` must not replace.

    Without ``force`` any existing path is refused. With ``force``, ``destination`` may be
    missing, an empty dir or a model dir (``is_model_dir``); never the filesystem root, nor
    a dir that is or contains the current directory, the source or the home dir.
    """
    if not destination.exists() and not destination.is_symlink():
        return
    if not force:
        raise MlxformerError(f"{destination} already exists (pass --force to replace it)")
    refuse = f"refusing to replace {destination}"
    if destination.is_symlink():
        raise MlxformerError(f"{refuse}: it is a symbolic link")
    target = destination.resolve()
    if target == Path(target.anchor):
        raise MlxformerError(f"{refuse}: it is the filesystem root")
    for what, path in (("the current directory", Path.cwd()), ("the source", source), ("the home dir", Path.home())):
        if _contains(target, path.expanduser().resolve()):
            raise MlxformerError(f"{refuse}: it is or contains {what}")
    if not target.is_dir() or (any(target.iterdir()) and not is_model_dir(target)):
        raise MlxformerError(f"{refuse}: it is not empty and not a model dir "
                             "(config.json and *.safetensors files, no subdirectories)")


@contextlib.contextmanager
def staged_output(destination: Path, source: Path, force: bool) -> Iterator[Path]:
    """A temporary sibling dir that replaces ``destination`` only if the body succeeds.

    ``destination`` is checked by ``check_destination``; on any failure the temporary
    dir is removed and ``destination`` is untouched.
    """
    check_destination(destination, source, force)
    if not destination.parent.is_dir():
        raise MlxformerError(f"{destination.parent}: no such directory")
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.tmp-", dir=destination.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes it private; the result should not be
    with _terminated_as_interrupt():
        try:
            yield staging
            _swap_into_place(staging, destination)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


@contextlib.contextmanager
def _terminated_as_interrupt() -> Iterator[None]:
    """SIGTERM (``kill``, a service manager) raises ``KeyboardInterrupt`` meanwhile, as Ctrl-C
    does, so the staging dir is removed (by default SIGTERM ends the process where it is); in
    the main thread only, where Python runs signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _swap_into_place(staging: Path, destination: Path) -> None:
    if not destination.exists():
        os.replace(staging, destination)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{destination.name}.old-", dir=destination.parent))
    os.rmdir(old)
    os.replace(destination, old)
    try:
        os.replace(staging, destination)
    except OSError:
        os.replace(old, destination)
        raise
    if old.is_dir():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)
