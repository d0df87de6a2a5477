"""The models in the Hugging Face cache, as ``list`` and ``rm`` (and the server's model list)
see them: huggingface_hub's own ``scan_cache_dir`` and ``DeleteCacheStrategy``, and the one
checkpoint reader for whether mlxformer can load each (headers only; no network).

A repo's main revision (else its newest) holds at most one safetensors model (named by the repo
id) and any number of GGUF models (named ``REPO:QUANT``, or ``REPO:FILE`` without a tag).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxformer.errors import MlxformerError
from mlxformer.formats.hub_gguf import GGUFModel, gguf_models, pick_gguf, split_ref
from mlxformer.formats.jsonio import read_json_object
from mlxformer.formats.safetensors import WEIGHT_GLOB


@dataclass(frozen=True)
class CachedModel:
    """One model in the cache."""

    name: str  # REPO, REPO:QUANT or REPO:FILE
    repo: str
    format: str  # "gguf" or "safetensors"
    quant: str  # the GGUF tag, "4-bit" (MLX quantized), or the config's dtype
    size: int  # bytes of its files
    path: Path  # what ``load`` opens: the snapshot dir or the (first) GGUF file
    files: tuple[Path, ...]  # its files in the snapshot (GGUF), or () for the whole snapshot
    problem: str | None  # why mlxformer cannot load it (None: it can)

    @property
    def loadable(self) -> bool:
        return self.problem is None


def _scan() -> Any:
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        return scan_cache_dir()
    except CacheNotFound:
        return None


def _main_revision(repo: Any) -> Any:
    revisions = sorted(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified))
    return revisions[-1] if revisions else None


def load_problem(path: Path) -> str | None:
    """Why mlxformer cannot load ``path`` (None: it can), without the path."""
    from mlxformer.formats.checkpoint import open_checkpoint

    try:
        open_checkpoint(path)
    except MlxformerError as exc:
        return str(exc).splitlines()[0].removeprefix(f"{path}: ")  # the path is the list's row
    return None


def safetensors_quant(snapshot: Path) -> str:
    """The quantization or dtype a checkpoint's config names ("?": none, or a config that does not
    read: ``load_problem`` says why, and one such repo never hides the others)."""
    try:
        config = read_json_object(snapshot / "config.json") if (snapshot / "config.json").is_file() else {}
    except MlxformerError:
        return "?"
    quantization = config.get("quantization") or config.get("quantization_config")
    if isinstance(quantization, dict) and "bits" in quantization:
        return f"{quantization['bits']}-bit"
    return str(config.get("torch_dtype") or config.get("dtype") or "?")


def cached_models(check: bool = True) -> list[CachedModel]:
    """Every model in the cache, sorted by name; ``check``: open each to see if it loads."""
    cache = _scan()
    out: list[CachedModel] = []
    for repo in sorted(cache.repos if cache is not None else [], key=lambda r: r.repo_id):
        revision = _main_revision(repo)
        if repo.repo_type != "model" or revision is None:
            continue
        snapshot = Path(revision.snapshot_path)
        files = {str(Path(f.file_path).relative_to(snapshot)): f.size_on_disk for f in revision.files}
        ggufs = gguf_models(files)
        for model in ggufs:
            path = snapshot / model.name
            out.append(CachedModel(_gguf_name(repo.repo_id, model), repo.repo_id, "gguf", model.quant or "?",
                                   model.size, path, tuple(snapshot / f for f in model.files),
                                   load_problem(path) if check else None))
        weights = any(fnmatch.fnmatch(name.rsplit("/", 1)[-1], WEIGHT_GLOB) for name in files)
        if weights or not ggufs:  # a repo without weights it can load is listed too (why not, and rm finds it)
            size = sum(s for name, s in files.items() if not name.lower().endswith(".gguf"))
            out.append(CachedModel(repo.repo_id, repo.repo_id, "safetensors" if weights else "?",
                                   safetensors_quant(snapshot), size, snapshot, (),
                                   load_problem(snapshot) if check else None))
    return sorted(out, key=lambda m: m.name)


def _gguf_name(repo: str, model: GGUFModel) -> str:
    return f"{repo}:{model.quant}" if model.quant else f"{repo}:{model.name}"


def find_cached(ref: str, check: bool = False) -> list[CachedModel]:
    """The cached models ``REPO[:QUANT]`` names: every model of the repo without a tag, else
    the one GGUF the tag picks; a one-line error when there is none."""
    repo, tag = split_ref(ref)
    models = [m for m in cached_models(check) if m.repo == repo]
    if not models:
        raise MlxformerError(f"{repo} is not in the Hugging Face cache (see 'mlxformer list')")
    if tag is None:
        return models
    ggufs = [m for m in models if m.format == "gguf"]
    described = [GGUFModel((m.path.name,), None if m.quant == "?" else m.quant, m.size) for m in ggufs]
    picked = pick_gguf(repo, described, tag)
    return [ggufs[described.index(picked)]]


def remove(models: list[CachedModel]) -> int:
    """Delete ``models`` from the cache; returns the bytes freed. A whole repo's folder goes
    through the hub's ``DeleteCacheStrategy``; one GGUF of a repo that keeps others loses its snapshot links
    and the blobs no other link uses."""
    from huggingface_hub.utils import DeleteCacheStrategy

    cache = _scan()
    if cache is None or not models:
        return 0
    repo_id = models[0].repo
    repo = next(r for r in cache.repos if r.repo_id == repo_id and r.repo_type == "model")
    if {m.name for m in models} >= {m.name for m in cached_models(check=False) if m.repo == repo_id}:
        # The hub's deletion of this repo's folder. Not ``delete_revisions``: it finds commit hashes
        # across the whole cache, so a repo sharing one (a git copy of another) would go instead.
        strategy = DeleteCacheStrategy(int(repo.size_on_disk), frozenset(), frozenset(), frozenset({repo.repo_path}),
                                       frozenset(), cache_dir=cache.cache_dir)
        strategy.execute()
        return int(strategy.expected_freed_size)
    doomed = {f for m in models for f in m.files}
    kept_blobs = {Path(f.blob_path) for r in repo.revisions for f in r.files if Path(f.file_path) not in doomed}
    freed = 0
    for revision in repo.revisions:
        for file in revision.files:
            if Path(file.file_path) in doomed:
                Path(file.file_path).unlink(missing_ok=True)
                blob = Path(file.blob_path)
                if blob not in kept_blobs and blob.exists():
                    freed += blob.stat().st_size
                    blob.unlink()
                    kept_blobs.add(blob)  # counted once
    return freed
