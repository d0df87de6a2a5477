"""Conversion: an HF/MLX dir, hub repo or GGUF file -> an mlx-lm compatible MLX dir.

The output is ``config.json`` (with mlx-lm's ``quantization`` entry when quantized),
``model.safetensors`` or shards plus ``model.safetensors.index.json``, the tokenizer files
and a short README.md. Tensors are read lazily and written shard by shard into a temporary
sibling dir that replaces the destination only when complete.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxformer.adapters.files import Adapter, read_adapter
from mlxformer.adapters.layers import fused_weight
from mlxformer.errors import MlxformerError
from mlxformer.formats.checkpoint import Checkpoint, open_checkpoint
from mlxformer.formats.hub import resolve_source
from mlxformer.formats.mlx_lm_layout import mlx_lm_config, mlx_lm_names, stored_for_mlx_lm
from mlxformer.formats.mlx_writer import MAX_SHARD_BYTES, check_destination, plan_shards, staged_output, write_shards
from mlxformer.loader import checked_model, load_tokenizer
from mlxformer.models.config import FLOAT_DTYPES, float_dtype
from mlxformer.models.dtype_policy import float16_safe
from mlxformer.models.families import MLX_LM_LAYOUT, text_config_of
from mlxformer.models.moe import QuantizedSwitchLinear, SwitchLinear
from mlxformer.quant.calibration import CALIBRATION_TEXT, activation_importance
from mlxformer.quant.quantize import (
    DEFAULT_RECIPE, QuantSpec, Recipe, bits_per_weight, check_spec, dequantize_matrix, get_recipe, layer_spec,
    quantization_entry, quantize_matrix,
)

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "generation_config.json",
)


@dataclass(frozen=True)
class ConvertSettings:
    """What the conversion should produce (validated)."""

    quantize: bool
    base: QuantSpec | None
    recipe: Recipe | None
    dtype: mx.Dtype | None
    dequantize: bool
    force: bool


def _settings(quantize: bool, q_bits: int | None, q_group_size: int | None, dtype: str | None,
              quant_recipe: str | None, dequantize: bool, force: bool) -> ConvertSettings:
    if not quantize and (q_bits is not None or q_group_size is not None or quant_recipe is not None):
        raise MlxformerError("--q-bits, --q-group-size and --quant-recipe need -q/--quantize")
    float_type = float_dtype(dtype, "--dtype")
    base = check_spec(4 if q_bits is None else q_bits, 64 if q_group_size is None else q_group_size) if quantize else None
    recipe = get_recipe(quant_recipe or DEFAULT_RECIPE) if quantize else None
    return ConvertSettings(quantize, base, recipe, float_type, dequantize, force)


def convert(
    hf_path: str | Path,
    mlx_path: str | Path = "mlx_model",
    quantize: bool = False,
    q_bits: int | None = None,
    q_group_size: int | None = None,
    dtype: str | None = None,
    quant_recipe: str | None = None,
    dequantize: bool = False,
    force: bool = False,
    *,
    max_shard_size: int = MAX_SHARD_BYTES,
    progress: bool = True,
    adapter: str | Path | None = None,
) -> Path:
    """Convert a checkpoint to an MLX model dir (mlx-lm/mlx-community layout); returns its path.

    Args:
        hf_path: HF repo id, local HF or MLX dir, or ``.gguf`` file.
        mlx_path: output dir; must not exist unless ``force``.
        quantize: quantize the matrices (default recipe unless ``quant_recipe``).
        q_bits, q_group_size: base bits (default 4) and group size (default 64).
        dtype: float16/bfloat16/float32 for float tensors and scales (default: keep the source's
            dtypes when not quantizing, float16 when quantizing; bfloat16 instead of float16 for
            a family whose activations overflow float16, see ``default_float_dtype``).
        quant_recipe: a name from ``mlxformer.quantize.RECIPES``.
        dequantize: turn a quantized source float (before ``quantize``, if both).
        force: replace an existing ``mlx_path`` once the new one is complete; only an empty dir
            or a model dir, never one holding the current dir, the source or the home dir.
        max_shard_size: largest output shard in bytes (a single bigger tensor gets its own).
        progress: show a progress bar.
        adapter: a LoRA/DoRA adapter dir (``adapters.read_adapter``) fused into the matrices it
            adapts (before quantizing, if quantizing).
    """
    settings = _settings(quantize, q_bits, q_group_size, dtype, quant_recipe, dequantize, force)
    destination = Path(mlx_path).expanduser().absolute()
    if destination.exists() and not force:
        raise MlxformerError(f"{destination} already exists (pass --force to replace it)")
    source_path = resolve_source(hf_path)
    check_destination(destination, source_path, force)  # before any work; staged_output checks again
    source = open_checkpoint(source_path)
    job = _Job(source, settings, read_adapter(adapter) if adapter is not None else None)
    with staged_output(destination, source_path, force) as staging:
        units = job.units()
        groups = plan_shards([(name, job.output_bytes(name)) for name in units], max_shard_size)
        write_shards(staging, groups, job.produce, progress=progress)
        job.write_metadata(staging, source_path)
    return destination


def default_float_dtype(quantize: bool, model_type: str, stored: set[mx.Dtype]) -> mx.Dtype | None:
    """The output's float dtype by default (None: each tensor keeps the source's): float16 for
    quantized outputs (more precise than bfloat16 for scales), but bfloat16 wherever the output
    would hold float16 for a family whose activations overflow float16 (mlx-lm computes in the
    weights' dtype: NaN logits); without quantizing, only the float16 tensors (``_Job._out_dtype``)."""
    if float16_safe(model_type):
        return mx.float16 if quantize else None
    return mx.bfloat16 if quantize or mx.float16 in stored else None


class _Job:
    """One conversion: the source, the per-matrix plan and the tensor producers."""

    def __init__(self, source: Checkpoint, settings: ConvertSettings, adapter: Adapter | None = None):
        self.source, self.settings = source, settings
        # the tokenizer checked before any tensor is written, then let go (held, a GGUF's vocabulary
        # sat beside the shards): a GGUF's from its metadata; a dir's files when it has any (a
        # weights-only dir converts its weights)
        if source.tokenizer_dir is None or any(
                (source.tokenizer_dir / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            load_tokenizer(source)
        self.adapted = {} if adapter is None else adapter.modules  # matrix path -> the update fused into it
        self.args = source.args
        self.source_quant = source.quantization
        model = checked_model(source.args, source.weights, source.quantization)  # parameters lazy: never evaluated
        # lazy: each tensor is read when its shard is written; hybrids in mlx-lm's layout
        self.args, self.weights = stored_for_mlx_lm(self.args, source.weights)
        self.entries = self.weights.entries  # shapes and dtypes, from the headers
        if self.args.rope.type == "freq_factors":
            raise MlxformerError(f"{source.path}: its rope_freqs factors are not llama3's, and mlx-lm cannot read "
                                 "a config with per-frequency rope factors; load the file directly instead")
        if self.source_quant and settings.quantize and not settings.dequantize and not source.is_gguf:
            raise MlxformerError("the source is already quantized; add --dequantize to requantize from its float values")
        self.modules = {path: m for path, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding,
                        nn.QuantizedLinear, nn.QuantizedEmbedding, SwitchLinear, QuantizedSwitchLinear))}
        for path in self.adapted:
            if path not in self.modules or not path.startswith("model.layers."):
                raise MlxformerError(f"adapter targets {path!r}, which is not a projection of the model's layers")
            if self._is_source_quantized(path) and not settings.dequantize:
                raise MlxformerError("fusing an adapter into a quantized source needs --dequantize (then -q to requantize)")
        stored = {e.dtype for e in self.entries.values()}
        default = default_float_dtype(settings.quantize, self.args.model_type, stored)
        self.float_dtype = settings.dtype or default
        # by default, a family that overflows float16 has only its float16 tensors turned bfloat16
        # (a packed matrix's float16 scales float32): float32 ones stay, every scale stays exact
        self.float16_only = settings.dtype is None and not settings.quantize and default is not None
        self.specs = self._plan() if settings.quantize else {}
        self.importance: dict[str, mx.array] = {}
        if settings.quantize and settings.recipe is not None and settings.recipe.calibrate:
            self.importance = self._calibrate()

    def _is_source_quantized(self, path: str) -> bool:
        return isinstance(self.modules[path], (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear))

    def _matrix_shape(self, path: str) -> tuple[int, int]:
        """``(rows, columns)`` of a matrix; stacked experts ``(experts, out, in)`` count
        ``experts * out`` rows (each expert's rows are quantized like a matrix's)."""
        module = self.modules[path]
        *lead, cols = module.weight.shape
        if self._is_source_quantized(path):
            cols = cols * 32 // module.bits
        return math.prod(lead), cols

    def _plan(self) -> dict[str, QuantSpec | None]:
        assert self.settings.base is not None and self.settings.recipe is not None
        return {path: layer_spec(self.settings.recipe, path, self._matrix_shape(path)[1], self.settings.base,
                                 self.args.num_hidden_layers) for path in self.modules}

    def _float_matrix(self, path: str) -> mx.array:
        """A matrix in float (dequantized from the exact packed values if the source is quantized),
        with the adapter's update fused in."""
        if path in self.adapted:
            return fused_weight(self._source_matrix(path), self.adapted[path])
        return self._source_matrix(path)

    def _source_matrix(self, path: str) -> mx.array:
        if not self._is_source_quantized(path):
            return self.weights[f"{path}.weight"]
        module = self.modules[path]
        spec = QuantSpec(module.bits, module.group_size, module.mode)
        w = self.weights
        packed, scales = w[f"{path}.weight"], w[f"{path}.scales"]
        biases = w[f"{path}.biases"] if f"{path}.biases" in w else None  # none in the float-scaled modes
        lead = packed.shape[:-1]  # (out,) or (experts, out)
        flat = (None if a is None else a.reshape(-1, a.shape[-1]) for a in (packed, scales, biases))
        return dequantize_matrix(*flat, spec).reshape(*lead, -1)  # type: ignore[arg-type]

    def _float32_params(self, prefix: str) -> dict[str, mx.array]:
        """The parameters of the module at ``prefix`` in float32, named relative to it, with
        quantized matrices dequantized (lazy: nothing is read until they are evaluated)."""
        params: dict[str, mx.array] = {}
        for key in self.weights:
            if not key.startswith(prefix + "."):
                continue
            path, leaf = key.rsplit(".", 1)
            if path in self.modules and leaf in ("scales", "biases"):
                continue  # part of a packed matrix: its float values come with "weight"
            value = self._float_matrix(path) if path in self.modules and leaf == "weight" else self.weights[key]
            params[key[len(prefix) + 1:]] = value.astype(mx.float32)
        return params

    def _calibrate(self) -> dict[str, mx.array]:
        """Activation importance of the float model on the calibration text, computed one
        decoder layer at a time (see ``activation_importance``)."""
        tokenizer = load_tokenizer(self.source)
        importance = activation_importance(self.args, self._float32_params, tokenizer.encode(CALIBRATION_TEXT))
        mx.clear_cache()
        return importance

    # ---- units: one per matrix (all its output tensors) or per other parameter

    def units(self) -> list[str]:
        """Output units in source order: a module path for matrices, a key for other tensors."""
        seen: list[str] = []
        for key in self.weights:
            path = key.rsplit(".", 1)[0]
            unit = path if path in self.modules and key.rsplit(".", 1)[1] in ("weight", "scales", "biases") else key
            if unit not in seen:
                seen.append(unit)
        return seen

    def _output_spec(self, path: str) -> QuantSpec | None:
        """The packed spec of a matrix in the output, or ``None`` if it is written float."""
        if self.settings.quantize:
            return self.specs[path]
        if self._is_source_quantized(path) and not self.settings.dequantize:
            module = self.modules[path]
            return QuantSpec(module.bits, module.group_size, module.mode)
        return None

    def output_bytes(self, unit: str) -> int:
        """Size of a unit's output tensors, known without evaluating them."""
        e = self.entries
        if unit not in self.modules:
            return e[unit].size * self._out_dtype(e[unit].dtype).size
        rows, cols = self._matrix_shape(unit)
        spec = self._output_spec(unit)
        if spec is None:
            dtype = self._out_dtype((e[f"{unit}.scales"] if self._is_source_quantized(unit)
                                     else e[f"{unit}.weight"]).dtype)
            return rows * cols * dtype.size
        if spec.mode != "affine":  # one uint8 scale per group
            return rows * cols * spec.bits // 8 + rows * (cols // spec.group_size)
        scale_dtype = self._scale_dtype(e.get(f"{unit}.scales", e[f"{unit}.weight"]).dtype)
        return rows * cols * spec.bits // 8 + 2 * rows * (cols // spec.group_size) * scale_dtype.size

    def produce(self, units: list[str]) -> dict[str, mx.array]:
        """The output tensors of ``units``."""
        out: dict[str, mx.array] = {}
        for unit in units:
            if unit not in self.modules:
                out[unit] = self._cast(self.weights[unit])
            else:
                out.update(self._matrix_outputs(unit))
        names = mlx_lm_names(self.args, out)  # GPT-2: mlx-lm's names
        return {names.get(name, name): array for name, array in out.items()}

    def _out_dtype(self, stored: mx.Dtype) -> mx.Dtype:
        """The dtype a float tensor stored in ``stored`` is written in."""
        if self.float_dtype is None or (self.float16_only and stored != mx.float16):
            return stored
        return self.float_dtype

    def _scale_dtype(self, stored: mx.Dtype) -> mx.Dtype:
        """The dtype a packed matrix's scales and biases stored in ``stored`` are written in:
        float16 ones of a family that overflows float16 become float32, which holds them exactly."""
        return mx.float32 if self.float16_only and stored == mx.float16 else self._out_dtype(stored)

    @staticmethod
    def _as(array: mx.array, dtype: mx.Dtype) -> mx.array:
        """``array`` in ``dtype`` (itself, uncast, when it is in it already)."""
        return array if array.dtype == dtype else array.astype(dtype)

    def _cast(self, array: mx.array) -> mx.array:
        return self._as(array, self._out_dtype(array.dtype))

    def _matrix_outputs(self, path: str) -> dict[str, mx.array]:
        w = self.weights
        keys = (f"{path}.weight", f"{path}.scales", f"{path}.biases")
        spec = self._output_spec(path)
        if self.settings.quantize and spec is not None:
            scale_dtype = self.float_dtype or mx.float16
            matrix = self._float_matrix(path)
            lead = matrix.shape[:-1]  # (out,) or (experts, out): experts' rows quantized as one matrix's
            packed = quantize_matrix(matrix.reshape(-1, matrix.shape[-1]), spec, self.importance.get(path),
                                     dtype=scale_dtype, search=self.settings.recipe.search if self.settings.recipe else True)
            return {key: array.reshape(*lead, -1) for key, array in zip(keys, packed)}
        if spec is not None and spec.mode != "affine":  # packed codes and uint8 scales kept as they are
            return {keys[0]: w[keys[0]], keys[1]: w[keys[1]]}
        if spec is not None:  # packed source kept exactly as it is
            scales, biases = w[keys[1]], w[keys[2]]  # each read once (a lazy source gives a tensor once)
            return {keys[0]: w[keys[0]], keys[1]: self._as(scales, self._scale_dtype(scales.dtype)),
                    keys[2]: self._as(biases, self._scale_dtype(biases.dtype))}
        if self._is_source_quantized(path) or path in self.adapted:
            stored = w[keys[1] if self._is_source_quantized(path) else keys[0]].dtype
            return {keys[0]: self._float_matrix(path).astype(self._out_dtype(stored))}
        return {keys[0]: self._cast(w[keys[0]])}

    # ---- config, tokenizer, model card

    def quantization(self) -> dict[str, Any] | None:
        """The output's ``quantization`` entry, or ``None`` for a float output."""
        if self.settings.quantize and self.settings.base is not None:
            return quantization_entry(self.settings.base, self.specs)
        if self.source_quant and not self.settings.dequantize:
            return {"mode": "affine", **self.source_quant}
        return None

    def bits_per_weight(self) -> float | None:
        """Average bits per matrix weight of a quantized output (see ``quantize.bits_per_weight``)."""
        specs = {p: self._output_spec(p) for p in self.modules}
        if all(s is None for s in specs.values()):
            return None
        return bits_per_weight(specs, {p: self._matrix_shape(p) for p in self.modules})

    def write_metadata(self, directory: Path, source_path: Path) -> None:
        """config.json, tokenizer files and README.md."""
        # The source config merged with what mlxformer understood of it, the normalized values
        # winning: one config that mlx-lm, transformers and mlxformer read alike (transformers 5
        # writes only ``rope_parameters``, a GGUF's config has llama.cpp's spellings; mlx-lm needs
        # the classic ``rope_theta``/``rope_scaling``, per-layer types, MoE sparsity keys, ...).
        source = text_config_of({k: v for k, v in self.source.config.items()
                                 if k not in ("quantization", "quantization_config", MLX_LM_LAYOUT)})  # an image-text model's, flat
        config = {**source, **{k: v for k, v in self.args.to_dict().items() if v is not None or k not in source}}
        config = mlx_lm_config(config)
        if self.float_dtype is not None:
            name = next(k for k, v in FLOAT_DTYPES.items() if v == self.float_dtype)
            config["torch_dtype"] = name
            if "dtype" in config:
                config["dtype"] = name
        quantization = self.quantization()
        if quantization:
            names = mlx_lm_names(self.args, quantization)  # per-layer entries under the written names
            quantization = {names.get(key, key): value for key, value in quantization.items()}
            config["quantization"] = quantization
            config["quantization_config"] = dict(quantization)
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        if self.source.tokenizer_dir is None:
            load_tokenizer(self.source).save(directory, generation_config=True)
        else:
            for name in TOKENIZER_FILES:
                if (self.source.tokenizer_dir / name).is_file():
                    shutil.copyfile(self.source.tokenizer_dir / name, directory / name)
        (directory / "README.md").write_text(self._model_card(source_path, quantization), encoding="utf-8")

    def _model_card(self, source_path: Path, quantization: dict[str, Any] | None) -> str:
        lines = ["---", "library_name: mlx", "tags: [mlx, mlxformer]", "---", "",
                 f"# {source_path.name} (MLX)", "",
                 f"Converted with `mlxformer convert` from `{source_path}`.", ""]
        if self.settings.quantize and self.settings.recipe and self.settings.base:
            lines.append(f"- quantization: recipe `{self.settings.recipe.name}` ({self.settings.recipe.description}), "
                         f"base {self.settings.base.bits} bits, group size {self.settings.base.group_size}")
        elif quantization:
            lines.append(f"- quantization: kept from the source ({quantization['bits']} bits, group "
                         f"{quantization['group_size']})")
        else:
            lines.append("- quantization: none" + (" (dequantized)" if self.settings.dequantize else ""))
        bpw = self.bits_per_weight()
        if bpw is not None:
            lines.append(f"- average bits per matrix weight: {bpw:.3f} (bits + 32/group_size, float matrices 16)")
        if self.float_dtype is not None:
            lines.append(f"- float dtype: {next(k for k, v in FLOAT_DTYPES.items() if v == self.float_dtype)}")
        lines += ["", "Load with `mlxformer.load(path)` or `mlx_lm.load(path)`.", ""]
        return "\n".join(lines)
