"""Reading LoRA/DoRA adapter dirs: mlx-lm's and PEFT's, into one ``Adapter``.

mlx-lm (``mlx_lm.lora``) writes ``adapters.safetensors`` with ``<module>.lora_a (in, r)``,
``<module>.lora_b (r, out)`` (DoRA: ``<module>.m (out,)``) under the model's own names and an
``adapter_config.json`` with ``fine_tune_type`` and ``lora_parameters.scale``. PEFT writes
``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight (r, in)``,
``lora_B.weight (out, r)`` (DoRA: ``lora_magnitude_vector (out,)``) and a config with ``r``,
``lora_alpha``, ``use_rslora`` (scale ``alpha / sqrt(r)``, else ``alpha / r``), ``use_dora``
and per-module ``rank_pattern``/``alpha_pattern``. Pickled ``.bin`` adapters are refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxformer.errors import MlxformerError
from mlxformer.formats.jsonio import read_json_object
from mlxformer.formats.safetensors import load_tensors

MLX_LM_WEIGHTS, PEFT_WEIGHTS, CONFIG = "adapters.safetensors", "adapter_model.safetensors", "adapter_config.json"
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LowRank:
    """One module's update: ``x @ a (in, r) @ b (r, out) * scale``; DoRA's learned
    ``magnitude (out,)`` rescales each output row of the adapted weight (None: plain LoRA)."""

    a: mx.array
    b: mx.array
    scale: float
    magnitude: mx.array | None = None


@dataclass(frozen=True)
class Adapter:
    """A read adapter: its modules' updates by module path (``model.layers.0.self_attn.q_proj``)."""

    path: Path
    kind: str  # "lora" or "dora"
    modules: dict[str, LowRank]
    digest: str = ""  # SHA-256 of its config and weights files: what it is, whatever its name or dir

    @property
    def rank(self) -> int:
        return max(m.a.shape[1] for m in self.modules.values())


def read_adapter(path: str | Path) -> Adapter:
    """The adapter in dir ``path`` (mlx-lm's or PEFT's layout), every tensor checked by name and shape."""
    path = Path(path)
    if not path.is_dir():
        raise MlxformerError(f"adapter {path}: not a directory")
    for weights, read in ((MLX_LM_WEIGHTS, _read_mlx_lm), (PEFT_WEIGHTS, _read_peft)):
        if (path / weights).is_file():
            digest = hashlib.sha256((path / CONFIG).read_bytes() if (path / CONFIG).is_file() else b"")
            digest.update((path / weights).read_bytes())
            return dataclasses.replace(read(path), digest=digest.hexdigest())
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise MlxformerError(f"adapter {path}: only safetensors adapters are read (a pickled .bin is never loaded); "
                             "save it with safe_serialization=True")
    raise MlxformerError(f"adapter {path}: no {MLX_LM_WEIGHTS} (mlx-lm) or {PEFT_WEIGHTS} (PEFT) found")


def _config(path: Path) -> dict[str, Any]:
    if not (path / CONFIG).is_file():
        raise MlxformerError(f"adapter {path}: {CONFIG} is missing")
    return read_json_object(path / CONFIG)


def _number(path: Path, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise MlxformerError(f"adapter {path}: {name} must be a number, got {value!r}")
    return float(value)


def _read_mlx_lm(path: Path) -> Adapter:
    config = _config(path)
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise MlxformerError(f"adapter {path}: fine_tune_type {kind!r} is not an adapter (lora or dora)")
    params = config.get("lora_parameters")
    if not isinstance(params, dict) or "scale" not in params:
        raise MlxformerError(f"adapter {path}: {CONFIG} needs lora_parameters.scale")
    scale = _number(path, "lora_parameters.scale", params["scale"])
    tensors = load_tensors(path / MLX_LM_WEIGHTS)
    modules: dict[str, LowRank] = {}
    for name in sorted(tensors):
        module, _, leaf = name.rpartition(".")
        if leaf not in ("lora_a", "lora_b", "m"):
            raise MlxformerError(f"adapter {path}: unexpected tensor {name!r} (only lora_a, lora_b and m)")
        if leaf == "lora_a":
            b, m = tensors.get(f"{module}.lora_b"), tensors.get(f"{module}.m")
            if b is None:
                raise MlxformerError(f"adapter {path}: {module}.lora_a has no {module}.lora_b")
            if kind == "dora" and m is None:
                raise MlxformerError(f"adapter {path}: DoRA module {module} has no magnitude {module}.m")
            modules[module] = _checked(path, module, tensors[name], b, scale, m if kind == "dora" else None)
    return Adapter(path, kind, _nonempty(path, modules))


def _read_peft(path: Path) -> Adapter:
    config = _config(path)
    if config.get("peft_type", "LORA") != "LORA":
        raise MlxformerError(f"adapter {path}: peft_type {config.get('peft_type')!r} is not supported (LORA only)")
    unsupported = {"fan_in_fan_out": config.get("fan_in_fan_out", False), "bias": config.get("bias", "none") != "none",
                   "modules_to_save": bool(config.get("modules_to_save")), "lora_bias": config.get("lora_bias", False),
                   "layer_replication": bool(config.get("layer_replication"))}
    if refused := [key for key, used in unsupported.items() if used]:
        raise MlxformerError(f"adapter {path}: {refused[0]} is not supported")
    r, alpha = _number(path, "r", config.get("r")), _number(path, "lora_alpha", config.get("lora_alpha", 8))
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    rs = bool(config.get("use_rslora", False))
    tensors = {}
    for name, array in load_tensors(path / PEFT_WEIGHTS).items():
        if not name.startswith(_PEFT_PREFIX):
            raise MlxformerError(f"adapter {path}: unexpected tensor {name!r} (PEFT's begin {_PEFT_PREFIX!r})")
        tensors[name.removeprefix(_PEFT_PREFIX)] = array
    modules: dict[str, LowRank] = {}
    for name in sorted(tensors):
        if ".lora_embedding_" in name:
            raise MlxformerError(f"adapter {path}: {name!r}: LoRA on embeddings is not supported")
        if not name.endswith((".lora_A.weight", ".lora_B.weight", ".lora_magnitude_vector")):
            raise MlxformerError(f"adapter {path}: unexpected tensor {name!r}")
        if not name.endswith(".lora_A.weight"):
            continue
        module = name.removesuffix(".lora_A.weight")
        b = tensors.get(f"{module}.lora_B.weight")
        if b is None:
            raise MlxformerError(f"adapter {path}: {name} has no {module}.lora_B.weight")
        rank = _number(path, "rank_pattern", _pattern(ranks, module, r))
        if rank != tensors[name].shape[0]:  # the scale is alpha / r: a config's r must be the tensors'
            raise MlxformerError(f"adapter {path}: {module}: r is {rank:g} in {CONFIG}, the tensors' rank is "
                                 f"{tensors[name].shape[0]}")
        a_alpha = _number(path, "alpha_pattern", _pattern(alphas, module, alpha))
        scale = a_alpha / math.sqrt(rank) if rs else a_alpha / rank
        m = tensors.get(f"{module}.lora_magnitude_vector")
        if config.get("use_dora") and m is None:
            raise MlxformerError(f"adapter {path}: DoRA module {module} has no lora_magnitude_vector")
        modules[module] = _checked(path, module, tensors[name].T, b.T, scale, m)
    return Adapter(path, "dora" if config.get("use_dora") else "lora", _nonempty(path, modules))


def _pattern(patterns: dict[str, Any], module: str, default: float) -> Any:
    """PEFT's per-module override: the first key matching the end of the module's path."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def _checked(path: Path, module: str, a: mx.array, b: mx.array, scale: float, m: mx.array | None) -> LowRank:
    """``a (in, r)``, ``b (r, out)``, ``m (out,)``: consistent ranks and sizes, float."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise MlxformerError(f"adapter {path}: {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not chain")
    if m is not None and tuple(m.shape) != (b.shape[1],):
        raise MlxformerError(f"adapter {path}: {module}: magnitude {tuple(m.shape)} does not match {b.shape[1]} outputs")
    for array in (a, b) + (() if m is None else (m,)):
        if not mx.issubdtype(array.dtype, mx.floating):
            raise MlxformerError(f"adapter {path}: {module}: tensors must be float, got {array.dtype}")
        if not mx.all(mx.isfinite(array)).item():
            raise MlxformerError(f"adapter {path}: {module}: tensors hold NaN or infinite values")
    return LowRank(a, b, scale, m)


def _nonempty(path: Path, modules: dict[str, LowRank]) -> dict[str, LowRank]:
    if not modules:
        raise MlxformerError(f"adapter {path}: holds no LoRA modules")
    return modules
