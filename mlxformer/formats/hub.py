"""Where a model comes from: a local path as is, or a Hugging Face ``REPO[:QUANT]`` resolved
through ``huggingface_hub`` (honouring ``HF_HUB_OFFLINE`` and the HF cache; no second cache).

A repo with safetensors weights is fetched as mlx-lm fetches it (``HUB_ALLOW_PATTERNS``). A
GGUF repo (one without such weights, or any repo named with ``:QUANT``) is resolved to one
GGUF model by ``hub_gguf.pick_gguf`` and only that file (or split set) is fetched; the path
returned is its (first) file. Offline, the repo's files are what the cache holds.
"""

from __future__ import annotations

import fnmatch
import importlib
import os
import re
from pathlib import Path
from typing import Callable

from mlxformer.errors import MlxformerError
from mlxformer.formats.hub_gguf import gguf_models, pick_gguf, pick_sidecar, split_ref
from mlxformer.formats.safetensors import WEIGHT_GLOB

# Only data files are fetched: never pickles, never code. The weights are ``model*.safetensors``
# (as mlx-lm fetches them): a Mistral repo's ``consolidated.safetensors`` copy is left out. An
# embedding model's sentence-transformers projections are ``2_Dense/model.safetensors`` and the like.
HUB_ALLOW_PATTERNS = ["*.json", WEIGHT_GLOB, "tokenizer.model", "*.jinja", "*.txt", "*_Dense/model.safetensors"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
USABLE_MEMORY_SHARE = 0.75  # a GGUF picked without a tag must fit in this share of physical memory


def is_repo_ref(text: str) -> bool:
    """Whether ``text`` reads as ``REPO[:QUANT]`` (not as a local file name)."""
    repo, _ = split_ref(text)
    return bool(_REPO_ID.match(repo)) and not repo.endswith(".gguf")


def resolve_source(path_or_repo: str | Path) -> Path:
    """A local path as is; otherwise ``REPO[:QUANT]`` fetched (or found in the HF cache)."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        return path
    text = str(path_or_repo)
    if not is_repo_ref(text):
        raise MlxformerError(f"no such file or directory: {text}")
    return fetch(text)


def _reason(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _hub_errors() -> tuple[type[BaseException], ...]:
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    return (LocalEntryNotFoundError, RepositoryNotFoundError, HfHubHTTPError, OSError, *_transport_errors())


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client's own errors (a refused connection, a timeout): huggingface-hub 2 uses
    ``httpx2``, 1.x ``httpx``; neither is ours to depend on, so whichever is installed."""
    for name in ("httpx2", "httpx"):
        try:
            return (importlib.import_module(name).HTTPError,)
        except ImportError:
            continue
    return ()


def repo_files(ref: str) -> dict[str, int]:
    """``{path: bytes}`` of the files of ``REPO[:QUANT]``'s repo: the hub's list, or offline (or
    with the hub unreachable) the cached snapshot's; errors name ``ref`` whole and say what failed."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import RepositoryNotFoundError

    repo, _ = split_ref(ref)
    unreachable = None
    if not constants.HF_HUB_OFFLINE:
        try:
            info = HfApi().model_info(repo, files_metadata=True)
            return {s.rfilename: int(s.size or 0) for s in info.siblings or []}
        except _hub_errors() as exc:
            if isinstance(exc, RepositoryNotFoundError):
                raise MlxformerError(f"{ref}: not a local path, and no such hub repo ({_reason(exc)})") from None
            unreachable = _reason(exc)
    snapshot = cached_snapshot(repo)
    if snapshot is None:
        why = ("downloads are off (HF_HUB_OFFLINE is set)" if unreachable is None
               else f"the Hugging Face hub cannot be reached ({unreachable})")
        raise MlxformerError(f"{ref}: not a local path, not in the Hugging Face cache, and {why}")
    return {str(p.relative_to(snapshot)): p.stat().st_size for p in snapshot.rglob("*") if p.is_file()}


def cached_snapshot(repo: str) -> Path | None:
    """The cached snapshot folder of ``repo``'s main revision, or None (no network)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo, local_files_only=True))
    except _hub_errors():
        return None


def _download(ref: str, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(split_ref(ref)[0], allow_patterns=patterns))
    except _hub_errors() as exc:
        raise MlxformerError(f"{ref}: the download from the Hugging Face hub failed ({_reason(exc)})") from None


def fetch_plan(ref: str) -> tuple[str, dict[str, int], str | None]:
    """What ``REPO[:QUANT]`` fetches: ``(repo, {file: bytes}, the GGUF file to open or None
    for the snapshot dir)`` (see the module docstring)."""
    repo, tag = split_ref(ref)
    files = repo_files(ref)
    models = gguf_models(files)
    has_weights = any(fnmatch.fnmatch(p.rsplit("/", 1)[-1], WEIGHT_GLOB) for p in files)
    if tag is None and (has_weights or not models):
        wanted = {p: size for p, size in files.items() if any(fnmatch.fnmatch(p, pat) for pat in HUB_ALLOW_PATTERNS)}
        return repo, wanted, None
    memory = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * USABLE_MEMORY_SHARE)
    model = pick_gguf(repo, models, tag, memory)
    return repo, {f: files[f] for f in model.files}, model.name


def fetch(ref: str, on_file: Callable[[str, int, bool], None] | None = None) -> Path:
    """Download (or find in the cache) what ``REPO[:QUANT]`` names: the model dir of a
    safetensors repo, the (first) file of the picked GGUF. ``on_file(file, bytes, done)`` is
    told before and after each file (then the files are fetched one by one)."""
    repo, files, main = fetch_plan(ref)
    if on_file is None:
        folder = _download(ref, HUB_ALLOW_PATTERNS if main is None else list(files))
    else:
        for name, size in files.items():
            on_file(name, size, False)
            folder = _download(ref, [name])
            on_file(name, size, True)
        folder = _download(ref, [*files] or HUB_ALLOW_PATTERNS)
    missing = [f for f in files if not (folder / f).is_file()]
    if missing:
        raise MlxformerError(f"{ref}: {missing[0]} is not in the cache (offline: HF_HUB_OFFLINE is set)")
    return folder if main is None else folder / main


def fetch_mtp_sidecar(ref: str) -> Path | None:
    """The ``mtp-*.gguf`` beside the GGUF that ``REPO[:QUANT]`` names (``hub_gguf.pick_sidecar``,
    llama.cpp's ``-hf REPO:QUANT --mtp``), fetched; None for a repo without one, or not a GGUF."""
    repo, _, main = fetch_plan(ref)
    sidecar = None if main is None else pick_sidecar(repo_files(ref), main, split_ref(ref)[1])
    if sidecar is None:
        return None
    path = _download(ref, [sidecar]) / sidecar
    if not path.is_file():
        raise MlxformerError(f"{repo}: {sidecar} is not in the cache (offline: HF_HUB_OFFLINE is set)")
    return path
