"""Tensor entries and the lazy name -> array mapping every checkpoint format provides."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import mlx.core as mx

from mlxformer.errors import MlxformerError

IN_MEMORY = Path("<in memory>")  # the ``file`` of a tensor given as an array (``Tensors.of_arrays``)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as its header describes it: HF name, shape and dtype as loaded, its file."""

    name: str
    shape: tuple[int, ...]
    dtype: mx.Dtype
    file: Path

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes once loaded."""
        return self.size * self.dtype.size


@dataclass(frozen=True)
class StackedEntry(TensorEntry):
    """A tensor made by stacking ``parts`` (same shape and dtype) along a new first axis."""

    parts: tuple[TensorEntry, ...] = ()


@dataclass(frozen=True)
class DerivedEntry(TensorEntry):
    """A tensor made from ``parts`` by ``make`` (a slice, a transpose, a reinterpretation of
    bytes, a concatenation)."""

    parts: tuple[TensorEntry, ...] = ()
    make: Callable[[list[mx.array]], mx.array] | None = None


@dataclass(frozen=True)
class Derivation:
    """How one tensor comes from others: the source names, the result's shape and dtype, and the
    map from the sources' arrays (in that order) to it."""

    sources: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: mx.Dtype
    make: Callable[[list[mx.array]], mx.array]


class Tensors(Mapping[str, mx.array]):
    """HF name -> array, lazily: ``entries`` (shapes, dtypes) come from the headers, and
    ``tensors[name]`` loads that tensor alone (safetensors: a lazy ``mx.load`` array; GGUF:
    the decoded tensor). Iteration is in file order; ``in`` never loads anything."""

    def __init__(self, entries: dict[str, TensorEntry], load: Callable[[TensorEntry], mx.array]):
        self.entries = entries
        self._load = load

    @classmethod
    def of_arrays(cls, arrays: Mapping[str, mx.array]) -> Tensors:
        """Arrays already in memory (a dict of weights) as the same lazy mapping a checkpoint
        gives, so they take the same renames and derivations (``formats.weight_map``)."""
        entries = {name: TensorEntry(name, tuple(a.shape), a.dtype, IN_MEMORY) for name, a in arrays.items()}
        return cls(entries, lambda entry: arrays[entry.name])

    def subset(self, names: Iterable[str]) -> Tensors:
        """The same tensors restricted to ``names`` (in this mapping's order)."""
        wanted = set(names)
        return Tensors({n: e for n, e in self.entries.items() if n in wanted}, self._load)

    def renamed(self, names: Mapping[str, str]) -> Tensors:
        """The same tensors with those in ``names`` (old -> new) under their new names."""
        if not names:
            return self
        return Tensors({names.get(n, n): e for n, e in self.entries.items()}, self._load)

    def stacked(self, groups: Mapping[str, list[str]]) -> Tensors:
        """The same tensors with each group of ``groups`` (stacked name -> member names) replaced
        by one lazy tensor stacking its members (mixture-of-experts matrices); shapes and dtypes
        of the members must agree."""
        entries = dict(self.entries)
        for stacked, names in groups.items():
            parts = tuple(entries.pop(n) for n in names)
            first = parts[0]
            for part in parts[1:]:
                if (part.shape, part.dtype) != (first.shape, first.dtype):
                    raise MlxformerError(f"{part.file}: {part.name} is {part.dtype} {list(part.shape)}, but "
                                         f"{first.name} is {first.dtype} {list(first.shape)}")
            entries[stacked] = StackedEntry(stacked, (len(parts), *first.shape), first.dtype, first.file, parts)
        base = self._load

        def load(entry: TensorEntry) -> mx.array:
            if isinstance(entry, StackedEntry):
                return mx.stack([base(part) for part in entry.parts])
            return base(entry)

        return Tensors(entries, load)

    def derived(self, derivations: Mapping[str, Derivation]) -> Tensors:
        """The same tensors with the sources of ``derivations`` replaced by the tensors made from
        them (still lazy: a derived tensor reads its sources when accessed): gpt-oss's fused
        experts split into the decoder's, mlx-lm's split ``kv_b_proj`` joined back (``models.mla``)."""
        used = {source for d in derivations.values() for source in d.sources}
        entries = {n: e for n, e in self.entries.items() if n not in used}
        for name, d in derivations.items():
            parts = tuple(self.entries[source] for source in d.sources)
            entries[name] = DerivedEntry(name, d.shape, d.dtype, parts[0].file, parts, d.make)
        base = self._load

        def load(entry: TensorEntry) -> mx.array:
            if isinstance(entry, DerivedEntry):
                assert entry.make is not None
                return entry.make([base(part) for part in entry.parts])
            return base(entry)

        return Tensors(entries, load)

    def __getitem__(self, name: str) -> mx.array:
        return self._load(self.entries[name])

    def load(self, entry: TensorEntry) -> mx.array:
        """The array of ``entry`` (one of ``entries``, or a part of a stacked or derived one)."""
        return self._load(entry)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)
