"""What a several-models server knows of a model before loading it, from its checkpoint's
headers, config and tokenizer files alone (never the weights): the weight bytes it will take
(``planning.footprint``), its context length and its ``/v1/models`` capabilities; and the
memory bound of the loaded models (``serve --max-loaded-memory BYTES|auto``), each counted as
its weights plus its KV budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxformer.engine.memory import device_memory, margin_for, parse_kv_memory
from mlxformer.errors import MlxformerError


@dataclass(frozen=True)
class ModelFacts:
    """A model's sizes and capabilities, read without loading it."""

    weights: int  # bytes of its weights once loaded
    context_length: int
    capabilities: dict[str, Any]


def model_facts(source: str, tool_parser: str | None = None) -> ModelFacts:
    """The facts of the model at ``source`` (a local path or REPO[:QUANT] in the cache)."""
    from mlxformer.formats.checkpoint import open_checkpoint
    from mlxformer.loader import load_tokenizer
    from mlxformer.tools.planning import footprint
    from mlxformer.server.translate import ServedModel
    from mlxformer.server.turn import Traits

    checkpoint = open_checkpoint(source)
    weights = footprint(checkpoint).loaded_bytes
    served = ServedModel("", load_tokenizer(checkpoint), checkpoint.args.max_position_embeddings,
                         checkpoint.args.vocab_size)
    return ModelFacts(weights, served.context_length, Traits.of(served, tool_parser).capabilities(served))


def parse_loaded_memory(text: str) -> int:
    """``--max-loaded-memory``: a byte count (``"8GiB"``, ``"500M"``…) or ``auto`` (the device's
    memory less the margin ``engine/memory.py`` keeps free for activations)."""
    try:
        value = parse_kv_memory(text)
    except MlxformerError:
        raise MlxformerError(f"--max-loaded-memory must be a byte count (e.g. 8GiB, 500M) or auto, got {text!r}") from None
    if value == "auto":
        memory = device_memory()
        return memory - margin_for(memory)
    return int(value)


def kv_budget_of(weights: int, max_kv_memory: int | str | None) -> int:
    """The KV bytes a model of ``weights`` bytes may hold under ``--max-kv-memory``: the byte
    count, ``auto``'s share (the device's memory less the weights and the margin, as the engine
    computes it), or 0 without a budget (its KV cache then is not bounded ahead)."""
    if max_kv_memory is None:
        return 0
    if max_kv_memory == "auto":
        memory = device_memory()
        return max(0, memory - weights - margin_for(memory))
    return int(max_kv_memory)


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
