"""Load a model across the ranks of a group and generate with it; rank 0 gets the responses."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import mlx.core as mx

from mlxformer.cache import CacheSettings
from mlxformer.distributed.group import PARALLEL_MODES, init_group, is_leader, shared_seed
from mlxformer.distributed.pipeline import PipelineLink, Stage, load_stage, serve_stage, stage_for
from mlxformer.distributed.tensor import load_tensor_shard
from mlxformer.distributed.watchdog import DEFAULT_TIMEOUT, Watchdog, check_timeout
from mlxformer.errors import MlxformerError
from mlxformer.formats.checkpoint import open_checkpoint
from mlxformer.generation.stream import GenerationResponse, stream_generate
from mlxformer.loader import load_tokenizer
from mlxformer.sampling.options import SamplingSettings
from mlxformer.generation.steps import default_prefill_step
from mlxformer.models.decoder import Model
from mlxformer.text.tokenizer import Tokenizer

# Ranks load at their own pace; the wait for the slowest is allowed this many timeouts.
LOAD_TIMEOUTS = 10


@dataclass
class DistributedModel:
    """This rank's part of a model spread over ``group``."""

    group: mx.distributed.Group
    parallel: str
    model: Model
    tokenizer: Tokenizer | None  # None on pipeline ranks other than 0
    watchdog: Watchdog
    stage: Stage | None = None  # pipeline only
    link: PipelineLink | None = None  # pipeline rank 0 only

    @property
    def leader(self) -> bool:
        """Whether this is rank 0, the one that prints."""
        return is_leader(self.group)


def load_distributed(
    path_or_repo: str | Path,
    parallel: str,
    dtype: mx.Dtype | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    with_tokenizer: bool = True,
) -> DistributedModel:
    """Join the ``mlx.launch`` group and load this rank's share of the model (``parallel``:
    ``"pipeline"`` or ``"tensor"``), reading only the tensors it holds. The ranks that run
    the generation loop also load the tokenizer, unless ``with_tokenizer`` is false."""
    if parallel not in PARALLEL_MODES:
        raise MlxformerError(f"unknown parallel mode {parallel!r} (choose from {', '.join(PARALLEL_MODES)})")
    check_timeout(timeout)  # before joining the group
    group = init_group()
    watchdog = Watchdog(group.rank(), timeout)
    checkpoint = open_checkpoint(path_or_repo)
    stage = link = None
    if parallel == "pipeline":
        stage = stage_for(checkpoint, group.rank(), group.size())
        model = load_stage(checkpoint, stage, dtype)
        if group.size() > 1 and stage.with_ends:
            link = PipelineLink(group, watchdog)
            model.use_remote_layers(link)
    else:
        model = load_tensor_shard(checkpoint, group, dtype)
    runs_loop = parallel == "tensor" or is_leader(group)
    tokenizer = load_tokenizer(checkpoint) if with_tokenizer and runs_loop else None
    with watchdog.guard("waiting for the other ranks to load", timeout * LOAD_TIMEOUTS):
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))
    return DistributedModel(group, parallel, model, tokenizer, watchdog, stage, link)


def stream_distributed(
    dist: DistributedModel,
    prompt: Sequence[int],
    max_tokens: int = 256,
    *,
    sampling: SamplingSettings = SamplingSettings(),
    stop: Sequence[str] = (),
    cache_settings: CacheSettings | None = None,
) -> Iterator[GenerationResponse]:
    """Generate on every rank; rank 0 gets the responses, the others yield nothing.

    Pipeline ranks other than 0 serve their layers until rank 0 is done; tensor-parallel
    ranks all run the generation loop with one shared seed."""
    if dist.parallel == "pipeline" and not dist.leader:
        serve_stage(dist.model, dist.group, dist.watchdog, cache_settings)
        return
    if dist.parallel == "tensor":
        given = sampling.seed if sampling.seed != -1 else None  # -1: a random seed, the same on every rank
        sampling = dataclasses.replace(sampling, seed=shared_seed(dist.group, given))
    if dist.tokenizer is None:
        raise MlxformerError("stream_distributed needs the model loaded with its tokenizer")
    responses = stream_generate(dist.model, dist.tokenizer, list(prompt), max_tokens, sampling=sampling, stop=stop,
                                cache_settings=cache_settings)
    if dist.parallel == "tensor":  # its sums are inside each step's graph: the watchdog guards each step
        chunks = -(-len(prompt) // default_prefill_step())  # the first response waits for the prompt's chunks too
        responses = dist.watchdog.each(responses, "waiting for the other ranks' partial sums", chunks + 1)
    try:  # pipeline: every wait for another rank is guarded where it happens (pipeline.py)
        for response in responses:
            if dist.leader:
                yield response
    except RuntimeError as exc:
        raise MlxformerError(
            f"rank {dist.group.rank()}: generation failed: {str(exc).strip()} (another rank failed or disconnected)"
        ) from None
    finally:
        dist.watchdog.disarm()
    if dist.link is not None:
        dist.link.stop()
