"""The models a server hosts, as the model-level APIs (Ollama's ``/api/*``, ``/v1/models``)
see them: ``ModelHost`` finds the ``ServerContext`` that serves a requested name and lists
every model with its state. ``SingleHost`` is the one-model server's; ``server/hosts.py``
hosts several, loaded on first use."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from mlxformer.server.context import ServerContext
from mlxformer.server.hosting import check_model


@dataclass(frozen=True)
class ModelRecord:
    """One hosted model, loaded or not."""

    name: str
    path: str  # where it loads from (a local path or REPO[:QUANT])
    format: str  # "gguf", "safetensors" or "" when unknown until loaded
    quant: str
    family: str  # the config's model_type ("" when unknown until loaded)
    size: int  # bytes of its files (0 when unknown)
    loaded: bool
    context_length: int | None
    expires_at: float | None = None  # epoch seconds when an idle model unloads (None: never)
    problem: str | None = None  # why its last load failed
    capabilities: dict[str, Any] | None = None  # its /v1/models capabilities (None when unknown)


class ModelHost(Protocol):
    """What the model-level routes need of the server's models."""

    async def context(self, name: str | None) -> ServerContext:
        """The context serving ``name`` (loading it if needed); 404 for an unknown name, 500 when
        it fails to load."""
        ...

    def finished(self, name: str | None, keep_alive: float | None) -> None:
        """A request to ``name`` is done: apply its ``keep_alive`` (seconds; 0: unload now;
        negative: keep; None: the server's default)."""
        ...

    def records(self) -> list[ModelRecord]:
        """Every hosted model."""
        ...

    def unload(self, name: str) -> bool:
        """Unload ``name`` if it is loaded; whether it was."""
        ...

    def add(self, name: str) -> None:
        """Serve the model ``name`` (a hub ``REPO[:QUANT]`` just pulled) too, if it can host more."""
        ...


def files_size(path: Path) -> int:
    """Bytes of a model's files: a GGUF file (all parts of a split one), or a dir's files."""
    from mlxformer.formats.gguf_split import split_part_names

    if path.is_file():
        parts = split_part_names(path.name) or [path.name]
        return sum(path.with_name(p).stat().st_size for p in parts if path.with_name(p).is_file())
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def loaded_record(name: str, path: str | None, ctx: ServerContext, expires_at: float | None = None) -> ModelRecord:
    """The record of a loaded model served by ``ctx``, loaded from ``path`` (None: unknown)."""
    from mlxformer.formats.hub import resolve_source
    from mlxformer.formats.hub_cache import safetensors_quant
    from mlxformer.formats.hub_gguf import quant_of

    family = ctx.engine.model.args.model_type
    capabilities = ctx.traits.capabilities(ctx.served) if ctx.traits is not None else None
    if path is None:
        return ModelRecord(name, "", "", "?", family, 0, True, ctx.served.context_length, expires_at,
                           capabilities=capabilities)
    local = resolve_source(path)
    is_gguf = local.is_file()
    quant = (quant_of(local.name) or "?") if is_gguf else safetensors_quant(local)
    return ModelRecord(name, path, "gguf" if is_gguf else "safetensors", quant, family, files_size(local), True,
                       ctx.served.context_length, expires_at, capabilities=capabilities)


class SingleHost:
    """One loaded model, serving the names ``check_model`` lets through."""

    def __init__(self, ctx: ServerContext, path: str | None = None) -> None:
        self.ctx, self.path = ctx, path
        self.started = time.time()

    async def context(self, name: str | None) -> ServerContext:
        check_model(self.ctx, name)
        return self.ctx

    def finished(self, name: str | None, keep_alive: float | None) -> None:
        return None  # the only model stays loaded

    def records(self) -> list[ModelRecord]:
        return [loaded_record(self.ctx.served.name, self.path, self.ctx)]

    def unload(self, name: str) -> bool:
        return False

    def add(self, name: str) -> None:
        return None  # one model's server serves its own
