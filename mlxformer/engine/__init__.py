"""Continuous batching: several sequences share each forward pass.

``Engine`` (``engine.py``) runs a background loop: schedule (``scheduler.py``: admission within
``max_batch`` and the KV budget, then a step as a token budget: every decoding row's token,
then prompt chunks, newcomers and the shortest first, a starved prompt first of all), run
(``batch_runner.py``: decode rows, prompt chunks and speculation rounds packed into one
forward where the model allows), hand out (``choices.py``: one sampling graph and one host
read per step), each request inside its own error boundary. ``admission.py`` gives admitted
sequences their caches (a prompt-cache hit from ``prefix_cache.py`` / ``disk_cache.py``, shared
prefixes between running requests: ``prefix_sharing.py``), ``memory.py`` plans each step
within ``max_kv_memory`` (evict, then preempt; ``replay.py`` recomputes a preempted sequence),
``jobs.py`` runs embedding and rerank forwards between steps, ``metrics.py`` exports
Prometheus metrics. ``batch_generate`` (``batch.py``) completes a list of prompts this way.
A request is a ``GenerationRequest``; its ``RequestHandle`` yields ``TokenEvent``s.
"""

from mlxformer.engine.batch import batch_generate
from mlxformer.engine.engine import Engine, EngineNotRunning
from mlxformer.engine.handle import RequestHandle
from mlxformer.engine.memory import KVBudgetExceeded
from mlxformer.engine.prompt_cache import PromptCacheSettings
from mlxformer.engine.scheduler import EngineOverloaded
from mlxformer.engine.request_state import GenerationRequest, TokenEvent

__all__ = [
    "Engine", "EngineNotRunning", "EngineOverloaded", "GenerationRequest", "KVBudgetExceeded", "PromptCacheSettings",
    "RequestHandle", "TokenEvent", "batch_generate",
]
