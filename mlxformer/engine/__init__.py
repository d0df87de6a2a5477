"""Continuous-batching generation: several sequences decode in one forward pass.

``Engine`` runs a background loop: each step it admits queued requests into free batch slots
(at most ``max_batch``; the queue holds at most ``max_queue``), runs one prompt chunk of the
oldest newcomer (reusing the cached blocks of a prefix it shares with earlier prompts:
``prompt_cache=PromptCacheSettings(...)``, in memory and optionally on disk) and one decode
step for every running sequence, then emits each sequence's ``TokenEvent``. Sequences keep
their own sampling settings, seeds, stop strings, penalties and constraints; a finished one
leaves at once. ``batch_generate`` completes a list of prompts this way. With
``speculative=SpeculativeSettings(...)`` each sequence decodes speculatively (prompt lookup or
a draft model; ``speculation.py``), with the same greedy output.
"""

from mlxformer.engine.batch import batch_generate
from mlxformer.engine.engine import Engine, EngineNotRunning
from mlxformer.engine.handle import RequestHandle
from mlxformer.engine.memory import KVBudgetExceeded
from mlxformer.engine.prompt_cache import PromptCacheSettings
from mlxformer.engine.scheduler import EngineOverloaded
from mlxformer.engine.sequence import GenerationRequest, TokenEvent

__all__ = [
    "Engine", "EngineNotRunning", "EngineOverloaded", "GenerationRequest", "KVBudgetExceeded", "PromptCacheSettings",
    "RequestHandle", "TokenEvent", "batch_generate",
]
