"""Gated DeltaNet GGUFs (``qwen35``, ``qwen35moe``, ``qwen3next``): what llama.cpp's
``convert_hf_to_gguf.py`` (``conversion/qwen.py``) did to the tensors, undone, so that the
decoder reads them in the HF layout (and ``convert`` writes that layout back).

The converter stores ``A_log`` as ``-exp(A_log)`` (``ssm_a``), the conv1d weight squeezed to
``(C, K)``, every RMSNorm but the gated one as ``1 + w``; Qwen3-Next's ``in_proj_qkvz``
un-interleaved into ``attn_qkv`` (all q heads, all k heads, all v heads) and ``attn_gate`` (z);
and, for Qwen3.5 with more value heads than key heads, every tensor indexed by value head
reordered from grouped by key head (``[K0v0, K0v1, K1v0, K1v1]``) to tiled
(``[K0v0, K1v0, K0v1, K1v1]``) for ggml's broadcast: the v rows of ``in_proj_qkv`` and the v
channels of the conv, the rows of ``in_proj_z/b/a``, ``A_log``, ``dt_bias`` and the columns of
``out_proj``. Row orders apply to a quantized matrix's ``weight``/``scales``/``biases`` alike;
columns move by whole quantization groups, so a quantized ``out_proj`` needs head dims that are
multiples of the group.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import mlx.core as mx

from mlxformer.errors import MlxformerError
from mlxformer.formats.gguf_quants import GROUP_SIZE
from mlxformer.formats.tensors import Derivation, TensorEntry, Tensors

HYBRID_ARCHS = ("qwen35", "qwen35moe", "qwen3next")
TILED_VALUE_HEADS = ("qwen35", "qwen35moe")  # the converter's _LinearAttentionVReorderBase
# The ``(1 + w)`` RMSNorms the converter stored with the 1 added (not the gated ``linear_attn.norm``).
SHIFTED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                 ".q_norm.weight", ".k_norm.weight",  # and the MTP head's (its layer's by the suffixes above)
                 "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight")
_DELTA = re.compile(r"^(model\.layers\.\d+\.linear_attn)\.(.+)$")
Make = Callable[[list[mx.array]], mx.array]


def grouped_heads(x: mx.array, axis: int, key_heads: int, width: int) -> mx.array:
    """Value heads of ``width`` entries along ``axis`` from the converter's tiled order back to
    grouped by key head (the inverse of its ``_reorder_v_heads``)."""
    axis %= x.ndim
    per_key = x.shape[axis] // width // key_heads
    # (..., per_key, key_heads, width, ...) -> (..., key_heads, per_key, width, ...)
    split = x.reshape(*x.shape[:axis], per_key, key_heads, width, *x.shape[axis + 1:])
    return mx.swapaxes(split, axis, axis + 1).reshape(x.shape)


class _Undo:
    """The derivations of one hybrid GGUF (sizes from its config)."""

    def __init__(self, arch: str, config: dict[str, Any], entries: dict[str, TensorEntry]):
        self.entries = entries
        self.n_k, self.n_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
        self.d_k, self.d_v = config["linear_key_head_dim"], config["linear_value_head_dim"]
        self.key_dim = self.n_k * self.d_k
        self.tiled = arch in TILED_VALUE_HEADS and self.n_k != self.n_v

    def _heads(self, axis: int, width: int, start: int = 0) -> Make:
        """Reorder the value heads of ``parts[0]`` along ``axis`` (from index ``start`` on)."""
        def make(parts: list[mx.array]) -> mx.array:
            x = parts[0]
            if not self.tiled:
                return x
            if not start:
                return grouped_heads(x, axis, self.n_k, width)
            head, tail = mx.split(x, [start], axis=axis)
            return mx.concatenate([head, grouped_heads(tail, axis, self.n_k, width)], axis=axis)
        return make

    def derivation(self, name: str, module: str, rest: str) -> Derivation | None:
        """How the decoder's tensor ``name`` (``{module}.{rest}``) comes from the GGUF's."""
        entry = self.entries[name]
        same = (name,), entry.shape, entry.dtype
        if rest == "A_log":  # ssm_a = -exp(A_log)
            reorder = self._heads(0, 1)
            return Derivation(*same, lambda p: reorder([mx.log(-p[0].astype(mx.float32)).astype(p[0].dtype)]))
        if rest == "dt_bias":
            return Derivation(*same, self._heads(0, 1))
        if rest == "conv1d.weight":  # (C, K) -> (C, 1, K), the v channels back in grouped order
            reorder = self._heads(0, self.d_v, 2 * self.key_dim)
            channels, kernel = entry.shape
            return Derivation((name,), (channels, 1, kernel), entry.dtype,
                              lambda p: reorder(p).reshape(channels, 1, kernel))
        projection = rest.rpartition(".")[0]
        if projection == "in_proj_qkv":
            return Derivation(*same, self._heads(0, self.d_v, 2 * self.key_dim))
        if projection == "in_proj_z":
            return Derivation(*same, self._heads(0, self.d_v))
        if projection in ("in_proj_b", "in_proj_a"):
            return Derivation(*same, self._heads(0, 1))
        if projection == "out_proj":
            quantized = f"{module}.out_proj.scales" in self.entries
            if self.tiled and quantized and self.d_v % GROUP_SIZE:
                raise MlxformerError(f"{module}.out_proj: quantized with value heads of {self.d_v} features, which "
                                     f"do not fill whole groups of {GROUP_SIZE}: their order cannot be restored")
            return Derivation(*same, self._heads(-1, entry.shape[-1] // self.n_v))
        return None

    def fused(self, module: str) -> dict[str, Derivation]:
        """Qwen3-Next's ``in_proj_qkvz`` from ``in_proj_qkv`` and ``in_proj_z``: each key head's
        q, k, v and z rows together again. Stored alike (float, or one quantized type), each of
        ``weight``/``scales``/``biases`` is fused as it is; stored differently (llama.cpp's
        ``_K_M`` mixes give ``attn_qkv`` more bits), the two are dequantized and fused in float32."""
        keys = ("weight", "scales", "biases")
        qkv = [self.entries.get(f"{module}.in_proj_qkv.{k}") for k in keys]
        z = [self.entries.get(f"{module}.in_proj_z.{k}") for k in keys]
        alike = [(e.dtype, e.shape[1:]) if e else None for e in qkv] == [(e.dtype, e.shape[1:]) if e else None for e in z]
        if alike:
            return {f"{module}.in_proj_qkvz.{k}": Derivation((a.name, b.name), (a.shape[0] + b.shape[0], *a.shape[1:]),
                                                             a.dtype, self._interleave)
                    for k, a, b in zip(keys, qkv, z) if a is not None and b is not None}
        qkv_parts, z_parts = [e for e in qkv if e], [e for e in z if e]
        rows, cols = qkv[0].shape[0] + z[0].shape[0], _columns(qkv_parts)
        split = len(qkv_parts)

        def make(parts: list[mx.array]) -> mx.array:
            return self._interleave([_float(parts[:split]), _float(parts[split:])])

        return {f"{module}.in_proj_qkvz.weight": Derivation(tuple(e.name for e in qkv_parts + z_parts), (rows, cols),
                                                            mx.float32, make)}

    def _interleave(self, parts: list[mx.array]) -> mx.array:
        """``[qkv rows (all q, all k, all v), z rows]`` -> the rows of each key head together."""
        q, k, v = mx.split(parts[0], [self.key_dim, 2 * self.key_dim], axis=0)
        # (rows, ...) -> (key heads, rows per head, ...) each, joined per head
        heads = [t.reshape(self.n_k, -1, *t.shape[1:]) for t in (q, k, v, parts[1])]
        return mx.concatenate(heads, axis=1).reshape(-1, *parts[0].shape[1:])


def _columns(parts: list[TensorEntry]) -> int:
    """Columns of a float matrix (``[weight]``) or a quantized one (``[weight, scales, biases]``)."""
    return parts[0].shape[-1] if len(parts) == 1 else parts[1].shape[-1] * GROUP_SIZE


def _float(parts: list[mx.array]) -> mx.array:
    """A float matrix, or a GGUF-decoded affine one (groups of ``GROUP_SIZE``) dequantized."""
    if len(parts) == 1:
        return parts[0].astype(mx.float32)
    weight, scales, biases = parts
    bits = weight.shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE)
    return mx.dequantize(weight, scales, biases, group_size=GROUP_SIZE, bits=bits).astype(mx.float32)


def undo_converter(arch: str, config: dict[str, Any], entries: dict[str, TensorEntry],
                   load: Callable[[TensorEntry], mx.array]
                   ) -> tuple[dict[str, Any], dict[str, TensorEntry], Callable[[TensorEntry], mx.array]]:
    """``(config, entries, load)`` of a hybrid GGUF with the converter's edits undone (module
    docstring); for ``qwen3next`` the quantization entries follow the fused projection."""
    undo, derivations = _Undo(arch, config, entries), {}
    for name, entry in entries.items():
        if name.endswith(SHIFTED_NORMS) and len(entry.shape) == 1:
            derivations[name] = Derivation((name,), entry.shape, entry.dtype, lambda p: p[0] - 1)
        elif name.endswith("shared_expert_gate.weight") and len(entry.shape) == 1:  # llama-quantize: (1, n) as (n,)
            derivations[name] = Derivation((name,), (1, *entry.shape), entry.dtype, lambda p: p[0][None])
        elif match := _DELTA.match(name):
            module, rest = match.groups()
            if arch == "qwen3next" and rest.startswith(("in_proj_qkv.", "in_proj_z.")):
                if f"{module}.in_proj_qkvz.weight" not in derivations:
                    derivations.update(undo.fused(module))
            elif (derivation := undo.derivation(name, module, rest)) is not None:
                derivations[name] = derivation
    tensors = Tensors(entries, load).derived(derivations)
    if arch == "qwen3next" and isinstance(config.get("quantization"), dict):
        config = {**config, "quantization": _fused_quantization(config["quantization"], tensors.entries)}
    return config, tensors.entries, tensors.load


def _fused_quantization(quantization: dict[str, Any], entries: dict[str, TensorEntry]) -> dict[str, Any]:
    """Per-layer ``in_proj_qkv`` entries as ``in_proj_qkvz``'s, when it stayed quantized (then
    ``in_proj_z``'s is the same)."""
    out = {}
    for key, value in quantization.items():
        if key.endswith(".in_proj_qkv"):
            key = key[: -len(".in_proj_qkv")] + ".in_proj_qkvz"
        elif key.endswith(".in_proj_z"):
            continue
        if not key.endswith(".in_proj_qkvz") or f"{key}.scales" in entries:
            out[key] = value
    return out
