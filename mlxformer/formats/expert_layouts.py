"""Mixture-of-experts matrices as checkpoints store them, as the decoder's stacked ones.

HF's per-expert matrices (``...experts.E.{w1,gate_proj,...}.weight``: Mixtral, Qwen-MoE,
OLMoE, DeepSeek, GLM) are stacked ``(experts, out, in)`` under mlx-lm's names
(``switch_mlp.*``, ``models.moe``); Gemma 4's fused ``experts.gate_up_proj`` is split into
``experts.switch_glu.*`` (``models.gemma4``). gpt-oss's fused and MXFP4 experts: ``gpt_oss``.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

import mlx.core as mx

from mlxformer.errors import MlxformerError
from mlxformer.formats.tensors import Derivation

# HF per-expert matrix names -> the stacked ones (Mixtral's w1/w2/w3 are gate/down/up).
_EXPERT_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj",
                 "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
_EXPERT_KEY = re.compile(r"^(.*)\.experts\.(\d+)\.(\w+)\.(weight|scales|biases)$")


def expert_groups(names: Iterable[str], num_experts: int) -> dict[str, list[str]]:
    """HF's per-expert names (``...experts.E.{w1,gate_proj,...}.weight``) grouped under the
    stacked name each becomes (``...switch_mlp.gate_proj.weight``), in expert order; a block
    missing an expert raises naming it."""
    found: dict[str, dict[int, str]] = {}
    for name in names:
        match = _EXPERT_KEY.match(name)
        if match is not None and match.group(3) in _EXPERT_NAMES:
            prefix, expert, proj, kind = match.groups()
            found.setdefault(f"{prefix}.switch_mlp.{_EXPERT_NAMES[proj]}.{kind}", {})[int(expert)] = name
    groups = {}
    for stacked, experts in found.items():
        if sorted(experts) != list(range(num_experts)):
            missing = sorted(set(range(num_experts)) - set(experts)) or sorted(set(experts) - set(range(num_experts)))
            raise MlxformerError(f"{stacked.rsplit('.switch_mlp', 1)[0]}.experts: expected experts "
                                 f"0..{num_experts - 1}, missing or extra {missing[:4]}")
        groups[stacked] = [experts[e] for e in range(num_experts)]
    return groups


_FUSED = re.compile(r"^(.*\.layers\.\d+\.experts)\.(gate_up_proj|down_proj)$")


def gemma4_expert_derivations(entries: Mapping[str, Any]) -> dict[str, Derivation]:
    """HF's fused experts ``experts.gate_up_proj`` ``(E, 2 * inter, hidden)`` (gate rows first)
    and ``experts.down_proj`` ``(E, hidden, inter)`` as ``experts.switch_glu.*.weight``."""
    out: dict[str, Derivation] = {}
    for name, entry in entries.items():
        match = _FUSED.match(name)
        if match is None:
            continue
        prefix, matrix = match.groups()
        shape, dtype = tuple(entry.shape), entry.dtype
        if matrix == "down_proj":
            out[f"{prefix}.switch_glu.down_proj.weight"] = Derivation((name,), shape, dtype, lambda a: a[0])
            continue
        if len(shape) != 3 or shape[1] % 2:
            raise MlxformerError(f"{name}: gate_up_proj must be (experts, 2 * inter, hidden), not {list(shape)}")
        half = shape[1] // 2
        for target, part in (("gate_proj", slice(0, half)), ("up_proj", slice(half, None))):
            out[f"{prefix}.switch_glu.{target}.weight"] = Derivation(
                (name,), (shape[0], half, shape[2]), dtype, lambda a, part=part: mx.contiguous(a[0][:, part]))
    return out
