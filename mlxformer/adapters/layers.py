"""Adapters on a loaded model: every adapted projection computes its base output and, beside
it, all its adapters' low-rank updates in two matmuls, each row weighted by its own choice.

A bank of ``n`` adapters concatenates, per projection, their ``A`` into ``(in, R)`` and their
``B`` (each adapter's scale folded in) into ``(R, out)``, ``R`` the sum of their ranks. A forward
selects adapters with per-token weights ``w (B, T, n)`` (the request's scale on its adapters, 0
elsewhere; all 0: the base model): ``y = base(x) + ((x @ A) * w[..., owner]) @ B``, where
``owner (R,)`` is the adapter of each column. That is the gathered product ``x @ A[i] @ B[i] * s``
of each row's adapter, with several adapters per row allowed, and the step's graph is the same
whatever the rows chose (punica/S-LoRA's batching; llama-server's per-request ``lora`` list).

DoRA rescales each output of the adapted weight by ``f = m / ||W + s B^T A^T||`` (per output
row, computed once here, dequantizing a quantized base): ``y = f * (W x + s B A x) + bias``; a
row at weight 1 on a DoRA adapter gets it, so a DoRA adapter takes scale 1 or 0 only.

The projection keeps its class (a subclass mixing ``Adapted`` in is swapped in, as
``row_sharding`` does), its parameters and names: the adapter's arrays are private, outside
the parameter tree. Adapters do not apply to the embedding or the output projection.
"""

from __future__ import annotations

import contextlib
import json
import math
from typing import Iterator, Protocol, Sequence, Union

import mlx.core as mx
import mlx.nn as nn

from mlxformer.adapters.files import Adapter, LowRank
from mlxformer.errors import MlxformerError

Weights = Union[tuple[float, ...], None]  # a request's weight on each adapter (None: the base model)

__all__ = ["AdapterBank", "Weights", "attach_adapters", "cache_salt", "dense_weight", "fused_weight", "select"]


class AdapterBank:
    """The adapters a model carries and the weights the next forward uses (``select``).

    ``always_on``: the one adapter of ``--adapter`` applies at scale 1 to every forward;
    otherwise a forward without a selection runs the base model."""

    def __init__(self, names: Sequence[str], adapters: Sequence[Adapter], always_on: bool = False) -> None:
        self.names, self.always_on = list(names), always_on
        self.kinds, self.paths = [a.kind for a in adapters], [str(a.path) for a in adapters]
        self.digests = [a.digest for a in adapters]
        self.default = mx.full((1, 1, len(self.names)), 1.0 if always_on else 0.0)  # (1, 1, n)
        self._weights, self._kept = self.default, self.default
        self.active = always_on  # whether the next forward adds any adapter's output (None selected: not)

    def index(self, name: str) -> int:
        """The position of adapter ``name`` (``MlxformerError`` naming the known ones)."""
        if name not in self.names:
            raise MlxformerError(f"unknown adapter {name!r} (loaded: {', '.join(self.names) or 'none'})")
        return self.names.index(name)

    def vector(self, picks: Sequence[tuple[int, float]]) -> list[float]:
        """The weights ``(n,)`` of a request picking ``(adapter index, scale)`` pairs."""
        out = [0.0] * len(self.names)
        for index, scale in picks:
            if self.kinds[index] == "dora" and scale not in (0.0, 1.0):
                raise MlxformerError(f"adapter {self.names[index]!r} is DoRA: its scale is 1 or 0, not {scale}")
            out[index] += float(scale)
        return out

    def cache_salt(self, weights: Weights) -> str:
        """What a request's keys/values depend on beyond its tokens: the adapters it runs with, by
        content (``PrefixCache.keys_for``; "" for the base model)."""
        weights = self.default[0, 0].tolist() if self.always_on else weights  # type: ignore[assignment]
        used = [(self.digests[i], w) for i, w in enumerate(weights or ()) if w]
        return "adapters:" + json.dumps(used) if used else ""

    def select(self, weights: mx.array | None, keep: mx.array | None = None) -> None:
        """The weights ``(B, T, n)`` (or ``(B, 1, n)``: per row) of the next forward's tokens
        (None: the default). ``keep``: the positions ``(K,)`` the last layer keeps past its
        attention (``Model.hidden_states``), whose weights its later projections take."""
        self._weights = self.default if weights is None else weights
        self.active = self.always_on or weights is not None
        per_token = self._weights.shape[1] > 1
        self._kept = self._weights[:, keep] if keep is not None and per_token else self._weights

    def weights_for(self, x: mx.array) -> mx.array:
        """The weights of the rows of ``x``: ``(B, T, in)``, or its tokens flattened ``(N, in)``
        (a mixture block's shared experts): the selected ones, or those the last layer kept."""
        for w in (self._weights, self._kept):
            if x.ndim == 3 and w.shape[0] in (1, x.shape[0]) and w.shape[1] in (1, x.shape[1]):
                return w
            if x.ndim == 2 and w.shape[0] * w.shape[1] in (1, x.shape[0]):
                return w.reshape(-1, w.shape[-1])  # (B, T, n) -> (N, n)
        raise ValueError(f"adapter weights {tuple(self._weights.shape)} do not fit inputs {tuple(x.shape)}")


def cache_salt(model: nn.Module, weights: Weights) -> str:
    """``AdapterBank.cache_salt`` of ``model``'s adapters ("" without any), once ``weights``
    (a request's) are checked: one finite number per adapter the model carries to choose."""
    bank: AdapterBank | None = model.adapter_bank  # type: ignore[assignment]
    if weights is not None:
        if bank is None or bank.always_on or len(weights) != len(bank.names):
            count = 0 if bank is None or bank.always_on else len(bank.names)
            raise MlxformerError(f"a request's adapter weights need one number per adapter to choose ({count}), "
                                 f"got {len(weights)}")
        if not all(math.isfinite(w) for w in weights):
            raise MlxformerError("a request's adapter weights must be finite")
    return "" if bank is None else bank.cache_salt(weights)


class Chooses(Protocol):
    """What picks adapters: a request's sequence or prompt chunk."""

    @property
    def adapters(self) -> tuple[float, ...] | None: ...


@contextlib.contextmanager
def select(model: nn.Module, parts: Sequence[tuple[Chooses, int]], keep: mx.array | None = None,
           rows: bool = False) -> Iterator[None]:
    """Around the building of a forward of ``model`` carrying per-request adapters: each part's
    ``adapters`` for its count of tokens, packed on one row ``(1, T, n)``, or one row each
    (``rows``: a decode batch, ``(B, 1, n)``); the base model again after. ``keep``: see
    ``AdapterBank.select``. Nothing happens (the parts are not read) without such adapters."""
    bank: AdapterBank | None = model.adapter_bank  # type: ignore[assignment]
    if bank is None or bank.always_on:
        yield
        return
    weights = [part.adapters for part, _ in parts]
    zero = (0.0,) * len(bank.names)
    vectors = [w or zero for w in weights]
    if all(w is None for w in weights):
        bank.select(None)
    elif rows:
        bank.select(mx.array(vectors)[:, None, :])  # (B, n) -> (B, 1, n)
    else:
        tokens = [vector for vector, (_, count) in zip(vectors, parts) for _ in range(count)]
        bank.select(mx.array(tokens)[None], keep)  # (T, n) -> (1, T, n)
    try:
        yield
    finally:
        bank.select(None)


class Adapted:
    """Mixed into a projection's class: its output plus the bank's updates (module docstring)."""

    _bank: AdapterBank
    _lora_a: mx.array  # (in, R)
    _lora_b: mx.array  # (R, out), scales folded in
    _owner: mx.array  # (R,) the adapter of each column
    _dora: mx.array | None  # (n, out): DoRA's output factor minus 1 (0: not DoRA)

    def __call__(self, x: mx.array) -> mx.array:
        y = super().__call__(x)  # type: ignore[misc]
        if not self._bank.active:  # every row on the base model
            return y
        w = self._bank.weights_for(x).astype(x.dtype)  # (B, T, n)
        h = (x @ self._lora_a) * mx.take(w, self._owner, axis=-1)  # (B, T, R)
        update = h @ self._lora_b  # (B, T, out)
        if self._dora is None:
            return y + update
        unbiased = y - self["bias"] if "bias" in self else y  # type: ignore[operator]
        return y + update + (w @ self._dora) * (unbiased + update)


_ADAPTED: dict[type, type] = {}  # projection class -> its subclass with ``Adapted`` mixed in


def dense_weight(module: nn.Module) -> mx.array:
    """A projection's weight ``(out, in)`` as floats (a quantized one dequantized)."""
    if isinstance(module, nn.QuantizedLinear):
        return mx.dequantize(module.weight, module.scales, module.get("biases"), group_size=module.group_size,
                             bits=module.bits, mode=module.mode)
    return module.weight


def _projection(model: nn.Module, path: str, modules: dict[str, nn.Module]) -> nn.Module:
    module = modules.get(path)
    if module is None or not path.startswith("model.layers.") or path.endswith(".kv_b_proj"):
        # (MLA's kv_b_proj is read as absorbed matrices, never called)
        raise MlxformerError(f"adapter targets {path!r}, which is not a projection of the model's layers "
                             "that adapters apply to")
    if not isinstance(module, (nn.Linear, nn.QuantizedLinear)):
        raise MlxformerError(f"adapter targets {path!r}, a {type(module).__name__} (only linear projections)")
    return module


def attach_adapters(model: nn.Module, adapters: Sequence[Adapter], names: Sequence[str],
                    always_on: bool = False) -> AdapterBank:
    """Put ``adapters`` (named ``names``) on ``model``'s projections; the bank that selects
    them is also ``model.adapter_bank``. Each module is checked against the projection's sizes."""
    if getattr(model, "adapter_bank", None) is not None:
        raise MlxformerError("the model already carries adapters")
    bank = AdapterBank(names, adapters, always_on)
    modules = dict(model.named_modules())
    for path in sorted({p for a in adapters for p in a.modules}):
        module = _projection(model, path, modules)
        weight = dense_weight(module)  # (out, in)
        out_dims, in_dims = weight.shape
        dtype = weight.dtype
        a_parts, b_parts, owner, dora = [], [], [], []
        for index, adapter in enumerate(adapters):
            low = adapter.modules.get(path)
            factor = mx.zeros((out_dims,), mx.float32)
            if low is not None:
                if low.a.shape[0] != in_dims or low.b.shape[1] != out_dims:
                    raise MlxformerError(f"adapter {adapter.path}: {path} maps {low.a.shape[0]} -> {low.b.shape[1]}, "
                                         f"the model's projection {in_dims} -> {out_dims}")
                a_parts.append(low.a.astype(mx.float32))
                b_parts.append(low.b.astype(mx.float32) * low.scale)
                owner += [index] * low.a.shape[1]
                if low.magnitude is not None:
                    factor = dora_factor(low, adapted_weight(weight, low)) - 1
            dora.append(factor)
        module.__class__ = _adapted_class(type(module))
        module._bank, module._owner = bank, mx.array(owner, mx.int32)
        module._lora_a = mx.concatenate(a_parts, axis=1).astype(dtype)
        module._lora_b = mx.concatenate(b_parts, axis=0).astype(dtype)
        module._dora = mx.stack(dora).astype(dtype) if any(a.kind == "dora" for a in adapters) else None
        mx.eval(module._lora_a, module._lora_b, module._owner, *([] if module._dora is None else [module._dora]))
    model.adapter_bank = bank
    return bank


def _adapted_class(cls: type) -> type:
    if issubclass(cls, Adapted):
        return cls
    if cls not in _ADAPTED:
        _ADAPTED[cls] = type(f"Adapted{cls.__name__}", (Adapted, cls), {})
    return _ADAPTED[cls]


def adapted_weight(weight: mx.array, low: LowRank) -> mx.array:
    """``W + s B^T A^T`` ``(out, in)`` in float32, for a float ``weight (out, in)``."""
    if (low.b.shape[1], low.a.shape[0]) != tuple(weight.shape):
        raise MlxformerError(f"an adapter maps {low.a.shape[0]} -> {low.b.shape[1]}, the projection "
                             f"{weight.shape[1]} -> {weight.shape[0]}")
    return weight.astype(mx.float32) + (low.a.astype(mx.float32) @ (low.b.astype(mx.float32) * low.scale)).T


def dora_factor(low: LowRank, adapted: mx.array) -> mx.array:
    """DoRA's per-output factor ``m / ||W + s B^T A^T||`` ``(out,)`` (``adapted``: the sum)."""
    assert low.magnitude is not None
    return low.magnitude.astype(mx.float32) / mx.linalg.norm(adapted, axis=1)


def fused_weight(weight: mx.array, low: LowRank) -> mx.array:
    """The float32 weight ``(out, in)`` of a projection with ``low`` folded in (DoRA's factor
    applied per output row): what ``convert --adapter`` writes."""
    adapted = adapted_weight(weight, low)
    return adapted if low.magnitude is None else dora_factor(low, adapted)[:, None] * adapted
