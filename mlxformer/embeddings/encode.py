"""Token ids -> embeddings: inputs grouped into padded batches under a token budget, one
forward each (prefill only: nothing is decoded; a long input of a causal model runs alone, in
chunks over a cache), then the model's ``EmbeddingHead`` (pooling, dense projections, L2 norm)."""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from mlxformer.cache import make_cache
from mlxformer.embeddings.head import EmbeddingHead
from mlxformer.errors import MlxformerError
from mlxformer.generation.decoding import check_prompt_ids
from mlxformer.models.decoder import Model
from mlxformer.sampling.options import check_strings
from mlxformer.text.tokenizer import Tokenizer

__all__ = ["BATCH_TOKENS", "batches", "embed", "embed_tokens", "encode_inputs", "pool", "pooled_batches", "shorten"]

BATCH_TOKENS = 8192  # padded tokens per forward (a longer input runs alone)
CHUNK_TOKENS = 1024  # a longer input runs alone, this many tokens at a time (causal models)


def encode_inputs(tokenizer: Tokenizer, texts: Sequence[str], prefix: str = "") -> list[list[int]]:
    """Each text after ``prefix`` (a prompt, ``EmbeddingHead.prefix``) as token ids, special
    tokens added as the tokenizer adds them (as sentence-transformers tokenizes)."""
    return [tokenizer.encode(prefix + text) for text in texts]


def batches(lengths: Sequence[int], budget: int = BATCH_TOKENS) -> list[list[int]]:
    """The inputs' indices in batches of similar lengths whose padded size (rows x longest)
    stays within ``budget`` tokens (an input longer than that or than ``CHUNK_TOKENS``: a batch
    of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for index in order:  # ascending: the newest input is the longest of its batch
        if groups and lengths[index] <= CHUNK_TOKENS and (len(groups[-1]) + 1) * lengths[index] <= budget:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def pool(hidden: mx.array, valid: mx.array, pooling: str) -> mx.array:
    """One vector per row ``(B, hidden)`` of hidden states ``(B, T, hidden)`` whose real tokens
    (``valid`` ``(B, T)``) come first: the last real token's, the first's or their mean."""
    hidden = hidden.astype(mx.float32)
    if pooling == "cls":
        return hidden[:, 0]
    counts = valid.sum(axis=1)  # (B,)
    if pooling == "last":
        return mx.take_along_axis(hidden, (counts - 1)[:, None, None], axis=1)[:, 0]
    return (hidden * valid[..., None]).sum(axis=1) / counts[:, None]


def _chunked(model: Model, ids: Sequence[int], pooling: str) -> mx.array:
    """``pool`` ``(1, hidden)`` of one input run ``CHUNK_TOKENS`` at a time over a cache, as a
    prompt is prefilled: attention holds a chunk's scores against the input, not the input's
    square (a 33k-token input took 18 GB in one forward)."""
    cache, tokens = make_cache(model), mx.array([list(ids)])
    first = last = total = mx.array(0.0)
    for start in range(0, len(ids), CHUNK_TOKENS):
        hidden = model.hidden_states(tokens[:, start:start + CHUNK_TOKENS], cache, rope_length=len(ids), watch=False)
        hidden = hidden.astype(mx.float32)
        first, last, total = first if start else hidden[:, 0], hidden[:, -1], total + hidden.sum(axis=1)
        mx.eval(first, last, total, [c.state for c in cache])
    return {"cls": first, "last": last}.get(pooling, total / len(ids))


def _head(pooled: mx.array, head: EmbeddingHead) -> mx.array:
    for dense in head.dense:
        pooled = dense(pooled)
    if head.normalize:
        pooled = pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
    return pooled


def pooled_batches(model: Model, inputs: Sequence[Sequence[int]], pooling: str,
                   finish: Callable[[mx.array], mx.array], budget: int = BATCH_TOKENS) -> np.ndarray:
    """``finish`` of the ``pooling`` of each input's final hidden states, float32 ``(N, ...)`` in
    the inputs' order: the inputs run in padded batches (``batches``), each one forward over no
    cache; a causal model's input longer than ``CHUNK_TOKENS`` runs alone in chunks (``_chunked``)."""
    if any(len(ids) == 0 for ids in inputs):
        raise MlxformerError("cannot embed an empty input")
    inputs = [check_prompt_ids(ids, model.args.vocab_size) for ids in inputs]
    limit = model.args.max_position_embeddings
    if longest := max((len(ids) for ids in inputs if len(ids) > limit), default=0):
        raise MlxformerError(f"this model's maximum context length is {limit} tokens; an input has {longest}")
    out: list[np.ndarray | None] = [None] * len(inputs)
    for group in batches([len(ids) for ids in inputs], budget):
        if len(inputs[group[0]]) > CHUNK_TOKENS and not model.args.bidirectional:
            out[group[0]] = np.array(finish(_chunked(model, inputs[group[0]], pooling)).astype(mx.float32))[0]
            continue
        width = max(len(inputs[i]) for i in group)
        rows = [list(inputs[i]) + [0] * (width - len(inputs[i])) for i in group]  # padded at the end
        valid = mx.array([[j < len(inputs[i]) for j in range(width)] for i in group])  # (B, T)
        hidden = model.hidden_states(mx.array(rows), valid=valid)  # (B, T, hidden)
        vectors = np.array(finish(pool(hidden, valid, pooling)).astype(mx.float32))
        for row, index in enumerate(group):
            out[index] = vectors[row]
    return np.stack(out)  # type: ignore[arg-type]


def embed_tokens(model: Model, inputs: Sequence[Sequence[int]], head: EmbeddingHead | None = None,
                 budget: int = BATCH_TOKENS) -> np.ndarray:
    """Embeddings ``(N, dims)`` float32 of token-id inputs, in their order, by ``head``
    (default: the model's, ``Model.embedding_head``)."""
    head = head or model.embedding_head
    return pooled_batches(model, inputs, head.pooling, lambda pooled: _head(pooled, head), budget)


def shorten(vectors: np.ndarray, dimensions: int | None, normalize: bool = True) -> np.ndarray:
    """Matryoshka truncation: the first ``dimensions`` features, L2-normalized again when ``normalize``."""
    if dimensions is None:
        return vectors
    if not 0 < dimensions <= vectors.shape[-1]:
        raise MlxformerError(f"dimensions must be between 1 and {vectors.shape[-1]}, got {dimensions}")
    cut = vectors[..., :dimensions]
    return cut / np.maximum(np.linalg.norm(cut, axis=-1, keepdims=True), 1e-12) if normalize else cut


def embed(model: Model, tokenizer: Tokenizer, texts: str | Sequence[str], *, prompt_name: str | None = None,
          dimensions: int | None = None, head: EmbeddingHead | None = None) -> np.ndarray:
    """Embed ``texts`` (one string or several) with ``model``: float32 ``(N, dims)``.

    Args:
        prompt_name: a prompt of the model's (``"query"``, ``"document"``...: sentence-transformers'
            ``prompts``, e.g. Qwen3-Embedding's query instruction) put before each text.
        dimensions: keep the first features only (Matryoshka models), normalized again.
        head: pooling, projections and normalization (default: the checkpoint's, ``Model.embedding_head``).
    """
    head = head or model.embedding_head
    texts = check_strings("texts", texts, empty=False)
    vectors = embed_tokens(model, encode_inputs(tokenizer, texts, head.prefix(prompt_name)), head)
    return shorten(vectors, dimensions, head.normalize)
