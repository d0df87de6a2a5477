"""Continuous batching: several sequences share each forward pass.

``Engine`` (``engine.py``) runs a background loop: schedule (``scheduler.py``: admission within
``max_batch`` and the KV budget, then a step as a token budget: every decoding row's token,
then prompt chunks, newcomers and the shortest first, a starved prompt first of all), run
(``batch_runner.py``: decode rows, prompt chunks and speculation rounds packed into one
forward over the KV pools, ``cache/pool.py``), hand out (``choices.py``: one sampling graph and
one host read per step), each request inside its own error boundary. The engine's named
collaborators share ``EngineParts`` (``parts.py``): ``Admission`` (``admission.py``) seats an
admitted sequence in its pool row (with a prompt-cache hit from ``prefix_cache.py`` /
``disk_cache.py``, settings in ``prompt_cache.py``; prefixes shared between running requests:
``prefix_sharing.py``) and fits each step within ``max_kv_memory`` (``memory.py``, a step's
activations: ``working_set.py``; evict, then preempt), ``DecodeStep`` (``decode_step.py``) runs
the batched forward and its fault path, ``Delivery`` (``delivery.py``) chooses and hands out the
tokens, ``Departures`` (``departures.py``) fails, retires, cancels and preempts (``replay.py``
recomputes a preempted sequence). A request is a ``GenerationRequest``; the engine's state of it
a ``RequestState`` (``request_state.py``; echo's prompt log-probs: ``prompt_scores.py``); its
``RequestHandle`` (``handle.py``) yields ``TokenEvent``s. ``jobs.py`` runs embedding and rerank
forwards between steps, ``metrics.py`` exports Prometheus metrics. ``batch_generate``
(``batch.py``) completes a list of prompts this way.
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
