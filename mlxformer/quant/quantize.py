"""Affine group quantization in MLX's packed format, with an error-minimizing scale search.

MLX stores a quantized matrix ``W (out, in)`` as ``weight`` (uint32, the codes as one
little-endian bit stream per row), ``scales`` and ``biases`` (one per group of
``group_size`` inputs), with ``W ≈ scales * q + biases`` and ``q`` in ``[0, 2**bits - 1]``.

``mx.quantize`` maps each group's min/max onto the code range (round-to-nearest). The
search here instead tries several candidate scales per group, fits scale and offset by
weighted least squares for each, and keeps the one with the least (importance-weighted)
squared error — the idea of llama.cpp's ``make_qkx2_quants``, written for whole matrices.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxformer.errors import MlxformerError

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
_CHUNK_ELEMENTS = 1 << 18  # rows are quantized in chunks of about this many weights
_SCALE_STEPS = np.linspace(-1.0, 1.0, 11)  # candidate code ranges: nmax + step
_REFINE_ROUNDS = 2


@dataclass(frozen=True)
class QuantSpec:
    """How one matrix is quantized."""

    bits: int
    group_size: int
    mode: str = "affine"  # or one of MLX's float-scaled formats: ``FLOAT_SCALED_MODES``

    def to_dict(self) -> dict[str, int | str]:
        out: dict[str, int | str] = {"group_size": self.group_size, "bits": self.bits}
        if self.mode != "affine":
            out["mode"] = self.mode
        return out

    @property
    def scale_bits(self) -> int:
        """Stored bits per group beside the codes: 16-bit scale and bias (affine), or one 8-bit scale."""
        return 32 if self.mode == "affine" else 8


# MLX's microscaling formats: (bits, group size) each fixes; one uint8 scale per group, no biases.
FLOAT_SCALED_MODES = {"mxfp4": (4, 32), "mxfp8": (8, 32), "nvfp4": (4, 16)}


def check_spec(bits: int, group_size: int) -> QuantSpec:
    """A ``QuantSpec`` if MLX supports the pair; otherwise a user error."""
    if bits not in SUPPORTED_BITS:
        raise MlxformerError(f"unsupported --q-bits {bits} (MLX supports {', '.join(map(str, SUPPORTED_BITS))})")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise MlxformerError(
            f"unsupported --q-group-size {group_size} (MLX supports {', '.join(map(str, SUPPORTED_GROUP_SIZES))})"
        )
    return QuantSpec(bits, group_size)


def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """Pack integer codes ``(rows, cols)`` into MLX's uint32 layout ``(rows, cols * bits / 32)``."""
    rows, cols = codes.shape
    q = codes.astype(mx.uint32).reshape(rows, cols // 32, 32)  # 32 codes fill exactly `bits` words
    words = [mx.zeros((rows, cols // 32), dtype=mx.uint32) for _ in range(bits)]
    for j in range(32):
        offset = j * bits
        word, shift = divmod(offset, 32)
        words[word] = words[word] | (q[:, :, j] << shift)
        if shift + bits > 32:  # the code straddles two words
            words[word + 1] = words[word + 1] | (q[:, :, j] >> (32 - shift))
    # (rows, cols/32, bits) -> (rows, cols*bits/32)
    return mx.stack(words, axis=-1).reshape(rows, cols * bits // 32)


class _Moments:
    """Per-group weighted sums that do not depend on the codes: ``Σw, Σwx, Σwx²`` and ``w·x``."""

    def __init__(self, x: mx.array, w: mx.array):
        self.w, self.wx = w, w * x
        self.sw = w.sum(-1, keepdims=True)
        self.sx = self.wx.sum(-1, keepdims=True)
        self.sxx = (self.wx * x).sum(-1, keepdims=True)


def _fit(m: _Moments, codes: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Weighted least-squares ``scale, offset`` for fixed codes, and the resulting error (per group)."""
    wl = m.w * codes
    sl = wl.sum(-1, keepdims=True)
    sl2 = (wl * codes).sum(-1, keepdims=True)
    sxl = (m.wx * codes).sum(-1, keepdims=True)
    det = m.sw * sl2 - sl * sl
    ok = det > 1e-9 * mx.maximum(m.sw * sl2, 1e-30)
    safe = mx.where(ok, det, 1.0)
    scale = mx.where(ok, (m.sw * sxl - m.sx * sl) / safe, 0.0)
    offset = mx.where(ok, (sl2 * m.sx - sl * sxl) / safe, m.sx / mx.maximum(m.sw, 1e-30))
    # Σw(s·l + o - x)² expanded, so no extra pass over the group is needed
    err = (scale * scale * sl2 + 2 * scale * offset * sl + offset * offset * m.sw
           - 2 * scale * sxl - 2 * offset * m.sx + m.sxx)
    return scale, offset, err


def _codes_for(x: mx.array, scale: mx.array, offset: mx.array, nmax: int) -> mx.array:
    safe = mx.where(scale == 0, 1.0, scale)
    return mx.clip(mx.round((x - offset) / safe), 0, nmax)


def _search_groups(x: mx.array, w: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    """Best ``(scale, offset)`` per group of ``x (G, g)`` under weights ``w (G, g)``."""
    nmax = 2**bits - 1
    moments = _Moments(x, w)
    lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    span = mx.maximum(hi - lo, 1e-12)
    shifted = x - lo
    best_scale, best_offset, best_err = _fit(moments, mx.clip(mx.round(shifted * (nmax / span)), 0, nmax))
    for step in _SCALE_STEPS:
        codes = mx.clip(mx.round(shifted * ((nmax + float(step)) / span)), 0, nmax)
        scale, offset, err = _fit(moments, codes)
        better = err < best_err
        best_scale = mx.where(better, scale, best_scale)
        best_offset = mx.where(better, offset, best_offset)
        best_err = mx.where(better, err, best_err)
    for _ in range(_REFINE_ROUNDS):  # alternate: re-round with the best fit, then refit
        scale, offset, err = _fit(moments, _codes_for(x, best_scale, best_offset, nmax))
        better = err < best_err
        best_scale = mx.where(better, scale, best_scale)
        best_offset = mx.where(better, offset, best_offset)
        best_err = mx.where(better, err, best_err)
    return best_scale, best_offset


def quantize_matrix(
    weight: mx.array,
    spec: QuantSpec,
    importance: mx.array | None = None,
    dtype: mx.Dtype = mx.float16,
    search: bool = True,
) -> tuple[mx.array, mx.array, mx.array]:
    """``(packed weight, scales, biases)`` of ``weight (out, in)`` in MLX's affine format.

    Args:
        weight: the float matrix.
        spec: bits and group size.
        importance: optional per-input-column weights (e.g. mean squared activations); the
            search minimizes the squared error weighted by them.
        dtype: dtype of the stored scales and biases; codes are recomputed after rounding to it.
        search: ``False`` is plain min/max round-to-nearest (``mx.quantize``).
    """
    if spec.mode != "affine":  # (packed, uint8 scales): nothing to search
        return tuple(mx.quantize(weight.astype(mx.float32), group_size=spec.group_size, bits=spec.bits,
                                 mode=spec.mode))  # type: ignore[return-value]
    if not search:
        packed, scales, biases = mx.quantize(weight.astype(mx.float32), group_size=spec.group_size, bits=spec.bits)
        return packed, scales.astype(dtype), biases.astype(dtype)
    rows, cols = weight.shape
    g, nmax = spec.group_size, 2**spec.bits - 1
    col_weights = mx.ones((cols,)) if importance is None else importance.astype(mx.float32)
    chunk = max(1, _CHUNK_ELEMENTS // cols)
    parts: list[tuple[mx.array, mx.array, mx.array]] = []
    for start in range(0, rows, chunk):
        x = weight[start:start + chunk].astype(mx.float32)
        n = x.shape[0]
        # (n, cols) -> (n * cols / g, g)
        xg = x.reshape(-1, g)
        # importance of column j times the weight's own magnitude (llama.cpp's imatrix weighting)
        sigma2 = 2 * mx.mean(mx.square(x), axis=1, keepdims=True)  # (n, 1)
        wg = (col_weights[None] * mx.sqrt(sigma2 + mx.square(x))).reshape(-1, g)
        scale, offset = _search_groups(xg, wg, spec.bits)
        scale, offset = scale.astype(dtype).astype(mx.float32), offset.astype(dtype).astype(mx.float32)
        codes = _codes_for(xg, scale, offset, nmax).reshape(n, cols)
        part = (pack_codes(codes, spec.bits), scale.reshape(n, -1).astype(dtype), offset.reshape(n, -1).astype(dtype))
        mx.eval(part)
        parts.append(part)
    return tuple(mx.concatenate([p[i] for p in parts], axis=0) for i in range(3))  # type: ignore[return-value]


def dequantize_matrix(packed: mx.array, scales: mx.array, biases: mx.array | None, spec: QuantSpec) -> mx.array:
    """The float32 matrix packed codes and their scales (and affine biases) stand for."""
    if spec.mode != "affine":
        return mx.dequantize(packed, scales, None, group_size=spec.group_size, bits=spec.bits, mode=spec.mode,
                             dtype=mx.float32)
    assert biases is not None
    return mx.dequantize(
        packed, scales.astype(mx.float32), biases.astype(mx.float32), group_size=spec.group_size, bits=spec.bits
    )


# ---------------------------------------------------------------------------- recipes


@dataclass(frozen=True)
class Rule:
    """Layers whose path contains ``fragment`` (in ``sensitive`` layers only, if set) get
    ``bits``/``group_size`` instead of the base values (``None`` keeps the base value)."""

    fragment: str
    bits: int | None = None
    group_size: int | None = None
    sensitive_only: bool = False


@dataclass(frozen=True)
class Recipe:
    """A named quantization recipe: the quantizer and the per-layer exceptions."""

    name: str
    description: str
    search: bool = True  # error-minimizing scale search (else min/max round-to-nearest)
    calibrate: bool = True  # weight the search by activations of the calibration text
    rules: tuple[Rule, ...] = ()
    mode: str = "affine"  # a float-scaled mode fixes bits and group size (``FLOAT_SCALED_MODES``)


RECIPES = {
    "rtn": Recipe("rtn", "uniform bits/group, plain min/max round-to-nearest (like mx.quantize)", False, False),
    "search": Recipe("search", "uniform bits/group, error-minimizing scale search (no calibration)", True, False),
    "uniform": Recipe("uniform", "uniform bits/group, scale search weighted by calibration activations"),
    "mixed": Recipe(
        "mixed", "uniform, plus group 32 for every mlp.down_proj (the most sensitive projection)",
        rules=(Rule("mlp.down_proj", group_size=32),),
    ),
    "mixed_embed": Recipe(
        "mixed_embed", "uniform, plus group 32 for the embedding/lm_head and v_proj, group 128 for mlp.down_proj",
        rules=(Rule("embed_tokens", group_size=32), Rule("lm_head", group_size=32),
               Rule("self_attn.v_proj", group_size=32), Rule("mlp.down_proj", group_size=128)),
    ),
    "mixed_6": Recipe(
        "mixed_6", "uniform, plus 6 bits for the embedding/lm_head and for v_proj/down_proj in the "
        "first and last eighth of the layers and every third layer (llama.cpp Q4_K_M-like)",
        rules=(
            Rule("embed_tokens", bits=6), Rule("lm_head", bits=6),
            Rule("self_attn.v_proj", bits=6, sensitive_only=True), Rule("mlp.down_proj", bits=6, sensitive_only=True),
        ),
    ),
}
RECIPES.update({mode: Recipe(mode, f"MLX's {mode} ({bits}-bit float codes, one 8-bit scale per {group}) for every "
                              "matrix whose width allows it", False, False, mode=mode)
                for mode, (bits, group) in FLOAT_SCALED_MODES.items()})
DEFAULT_RECIPE = "mixed"


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``; unknown names are a user error."""
    if name not in RECIPES:
        raise MlxformerError(f"unknown --quant-recipe {name!r} (choose from {', '.join(RECIPES)})")
    return RECIPES[name]


def _is_sensitive(path: str, n_layers: int) -> bool:
    parts = path.split(".")
    if len(parts) < 3 or parts[1] != "layers":
        return True
    i, eighth = int(parts[2]), max(1, n_layers // 8)
    return i < eighth or i >= n_layers - eighth or (i - eighth) % 3 == 2


def layer_spec(recipe: Recipe, path: str, in_features: int, base: QuantSpec, n_layers: int) -> QuantSpec | None:
    """The spec for one matrix; the group shrinks to one that divides ``in_features``, and
    ``None`` (kept float) when even 32 does not."""
    if recipe.mode != "affine":
        bits, group = FLOAT_SCALED_MODES[recipe.mode]
        return QuantSpec(bits, group, recipe.mode) if in_features % group == 0 else None
    bits, group = base.bits, base.group_size
    for rule in recipe.rules:
        if rule.fragment in path and (not rule.sensitive_only or _is_sensitive(path, n_layers)):
            bits = rule.bits or bits
            group = rule.group_size or group
    fitting = [g for g in SUPPORTED_GROUP_SIZES if g <= group and in_features % g == 0]
    return QuantSpec(bits, max(fitting)) if fitting else None


def bits_per_weight(specs: dict[str, QuantSpec | None], shapes: dict[str, tuple[int, ...]], float_bits: int = 16) -> float:
    """Average stored bits per matrix weight: ``bits + scale_bits / group_size`` (16-bit scale
    and bias, or one 8-bit scale, per group) for quantized matrices, ``float_bits`` for matrices
    kept float."""
    total_bits = total_weights = 0.0
    for path, spec in specs.items():
        n = float(np.prod(shapes[path]))
        total_weights += n
        total_bits += n * (spec.bits + spec.scale_bits / spec.group_size if spec else float_bits)
    return total_bits / total_weights


def quantization_entry(base: QuantSpec, specs: dict[str, QuantSpec | None]) -> dict[str, object]:
    """The mlx-lm ``quantization`` config entry: the base spec plus per-layer overrides."""
    entry: dict[str, object] = {"group_size": base.group_size, "bits": base.bits, "mode": "affine"}
    used = {spec for spec in specs.values() if spec is not None}
    if len(used) == 1:  # one spec for every quantized matrix (a float-scaled recipe): it is the base
        base = used.pop()
        entry = {"mode": "affine", **base.to_dict()}
    for path, spec in sorted(specs.items()):
        if spec is not None and spec != base:
            entry[path] = spec.to_dict()
    return entry
