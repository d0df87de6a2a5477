"""The one checkpoint reader: ``open_checkpoint(path)`` for HF dirs, MLX dirs and GGUF files.

It returns a ``Checkpoint``: the config (an HF ``config.json`` dict; for GGUF, made from the
metadata), a lazy ``Tensors`` mapping of HF names to arrays (shape and dtype known from the
headers, each tensor loaded alone on access), where the tokenizer comes from and the header
sizes. Every count, shape, dtype and path of the files is checked while opening, before any
tensor is read or any model is built; errors name the file and the key. The loader, the
converter, ``info`` and distributed loading all read through it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Mapping

import mlx.core as mx

from mlxformer.models.families import text_config_of
from mlxformer.errors import MlxformerError
from mlxformer.formats.gguf import open_gguf
from mlxformer.formats.hub import resolve_source
from mlxformer.formats.mlx_lm_layout import with_stored_layout
from mlxformer.formats.safetensors import ShardReader, read_config, read_safetensors_header, weight_files
from mlxformer.formats.tensors import TensorEntry, Tensors
from mlxformer.formats.weight_map import decoder_quantization, decoder_weights, text_weight_names
from mlxformer.models.config import ModelArgs

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# MLX's quantization modes: affine (scales and biases) and the float-scaled microscaling formats.
QUANT_MODES = ("affine", "mxfp4", "mxfp8", "nvfp4")
# Config sizes a decoder is built from: each must be a positive int below 2**31.
SIZE_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "vocab_size", "max_position_embeddings")
# Sizes a config may leave out: derived (heads, head size), defaulted (context), or not used by
# every model (a dense MLP's width: Qwen3.5-MoE's layers are all experts; ``MLP`` refuses 0).
OPTIONAL_SIZE_KEYS = ("num_key_value_heads", "head_dim", "max_position_embeddings", "intermediate_size")


@dataclass(frozen=True)
class Checkpoint:
    """An opened checkpoint (see the module docstring)."""

    path: Path  # the resolved model dir or .gguf file
    config: dict[str, Any]
    args: ModelArgs  # built once, from ``config``, when the checkpoint is opened
    tensors: Tensors  # under the file's names (HF's; a GGUF's mapped by ``gguf_names``)
    tokenizer_dir: Path | None  # where tokenizer files live (HF/MLX dirs)
    gguf_metadata: dict[str, Any] | None  # the GGUF's metadata (its vocabulary), else None
    header_bytes: int  # bytes of all headers read to open it

    @property
    def is_gguf(self) -> bool:
        return self.gguf_metadata is not None

    @cached_property
    def weights(self) -> Tensors:
        """The tensors the decoder uses, under its names, still lazy (``weight_map.decoder_weights``)."""
        return decoder_weights(self.args, self.tensors)

    @cached_property
    def quantization(self) -> dict[str, Any] | None:
        """The config's ``quantization`` entry under the decoder's names (None: not quantized)."""
        return decoder_quantization(self.config)

    def read(self, tensors: Tensors, piece: Callable[[str, mx.array], mx.array] | None = None
             ) -> dict[str, mx.array]:
        """The lazy ``tensors`` (this checkpoint's ``weights``, maybe a subset), each cut by
        ``piece(name, array)`` if given (a distributed rank's share) and evaluated before the
        next is read: peak memory is what is kept plus one full tensor."""
        out: dict[str, mx.array] = {}
        for name in tensors:
            array = tensors[name]
            if piece is not None:
                array = mx.contiguous(piece(name, array))  # a copy: the full tensor is freed
            mx.eval(array)
            out[name] = array
        return out


def open_checkpoint(path_or_repo: str | Path) -> Checkpoint:
    """Open a local HF/MLX dir, a hub repo id or a ``.gguf`` file: headers and config only,
    all checked (the config against the tensor names too); no tensor data is read."""
    source = resolve_source(path_or_repo)
    config, tensors, metadata, header_bytes = _open_files(source)
    args = check_config(config, tensors.entries, source)
    return Checkpoint(source, config, args, tensors, None if source.is_file() else source, metadata, header_bytes)


def open_part(path_or_repo: str | Path) -> tuple[Path, dict[str, Any], Tensors]:
    """``(path, config, tensors)`` of a checkpoint that may hold only part of a model (llama.cpp's
    MTP GGUF: the multi-token-prediction block beside the embedding and output): its headers
    and names checked as ``open_checkpoint`` checks them, but not that they make a whole decoder."""
    source = resolve_source(path_or_repo)
    config, tensors, _, _ = _open_files(source)
    _check_quantization(config, f"{source}: config" if source.is_dir() else f"{source}: metadata")
    return source, config, tensors


def _open_files(source: Path) -> tuple[dict[str, Any], Tensors, dict[str, Any] | None, int]:
    """``(config, tensors, GGUF metadata or None, header bytes)`` of a model dir or .gguf file."""
    if source.is_file():
        if source.suffix.lower() != ".gguf":
            raise MlxformerError(f"{source}: not a model dir or .gguf file")
        config, entries, load, metadata, header_bytes = open_gguf(source)
        return config, Tensors(entries, load), metadata, header_bytes
    config = read_config(source)
    tensors, header_bytes = _open_safetensors(source)
    return with_stored_layout(config, tensors.entries), tensors, None, header_bytes


def _open_safetensors(directory: Path) -> tuple[Tensors, int]:
    entries: dict[str, TensorEntry] = {}
    header_bytes = 0
    for file, listed in weight_files(directory).items():
        header, size = read_safetensors_header(file)
        header_bytes += size
        if listed is not None:
            absent = [n for n in listed if n not in header]
            if absent:
                raise MlxformerError(f"{file}: tensor {absent[0]!r}, which the shard index places here, is not in it")
        for name in header if listed is None else listed:
            if name in entries:
                raise MlxformerError(f"{file}: tensor {name!r} is also in {entries[name].file.name}")
            shape, dtype = header[name]
            entries[name] = TensorEntry(name, shape, dtype, file)
    reader = ShardReader()
    return Tensors(entries, lambda entry: reader(entry.file, entry.name)), header_bytes


def check_config(config: dict[str, Any], entries: Mapping[str, TensorEntry], source: Path) -> ModelArgs:
    """The model args of ``config``, after checking its sizes and that its layer count is the
    tensors' (a corrupt count must not make the decoder build millions of layers)."""
    where = f"{source}: config" if source.is_dir() else f"{source}: metadata"
    config = text_config_of(config)  # an image-text model's language model
    for key in SIZE_KEYS:
        value = config.get(key)
        if value is None and key in OPTIONAL_SIZE_KEYS:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 1 << 31:
            raise MlxformerError(f"{where} {key} is not a positive integer below 2**31: {str(value)[:40]}")
    _check_quantization(config, where)
    try:
        args = ModelArgs.from_dict(config)
    except MlxformerError as exc:
        raise MlxformerError(f"{source}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise MlxformerError(f"{where} has a value of the wrong type ({exc})") from None
    renames = text_weight_names(entries)
    layers = {int(m.group(1)) for name in entries if (m := _LAYER.match(renames.get(name, name)))}
    if not layers and any(name.startswith("mtp.") for name in entries):
        raise MlxformerError(f"{source}: holds only a multi-token-prediction head (llama.cpp's convert_hf_to_gguf.py "
                             "--mtp output): load the model's own file and pass this one as --mtp FILE")
    if layers - set(range(args.num_hidden_layers, args.num_hidden_layers + args.mtp_layers)) != set(
            range(args.num_hidden_layers)):  # beside the multi-token-prediction layers (GLM, DeepSeek)
        raise MlxformerError(f"{where} says {config.get('num_hidden_layers')} layers, but the tensors are for "
                             f"{len(layers)} (indices up to {max(layers, default=-1)})")
    return args


def _check_quantization(config: dict[str, Any], where: str) -> None:
    """mlx-lm's ``quantization`` entry: ints ``group_size``/``bits``, one of MLX's modes, and
    per-layer entries that are such a dict or a bool."""
    quantization = config.get("quantization") or config.get("quantization_config")
    if quantization is None:
        return
    if not isinstance(quantization, dict):
        raise MlxformerError(f"{where} quantization is not an object")

    def spec_ok(spec: dict[str, Any]) -> bool:
        if spec.get("mode", "affine") not in QUANT_MODES:
            raise MlxformerError(f"{where} quantization mode {str(spec['mode'])[:40]!r} is not supported "
                                 f"(supported: {', '.join(QUANT_MODES)})")
        return all(isinstance(spec.get(k, 1), int) and not isinstance(spec.get(k, 1), bool) and spec.get(k, 1) > 0
                   for k in ("group_size", "bits"))

    if quantization.get("quant_method") == "mxfp4":  # gpt-oss's experts as published (``formats.gpt_oss``)
        return
    if "quant_method" in quantization:  # transformers' GPTQ/AWQ/bitsandbytes/... checkpoints
        raise MlxformerError(f"{where} uses quantization method {str(quantization['quant_method'])[:40]!r}, "
                             "which is not supported (only MLX affine quantization)")
    if not spec_ok(quantization):
        raise MlxformerError(f"{where} quantization group_size/bits are not positive integers")
    for key, value in quantization.items():
        if key in ("group_size", "bits", "mode"):
            continue
        if not (isinstance(value, bool) or (isinstance(value, dict) and {"group_size", "bits"} <= set(value)
                                            and spec_ok(value))):
            raise MlxformerError(f"{where} quantization entry for {key[:80]!r} is not true/false or "
                                 "{group_size, bits}")
