"""Relevance scores of documents for a query, from a decoder reranker: Qwen3-Reranker (the
"yes"/"no" logits of its judging template's last token, a causal LM) or a cross-encoder decoder
(``*ForSequenceClassification``: its ``score`` head on the same template's last token)."""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx

from mlxformer.embeddings.encode import BATCH_TOKENS, pooled_batches
from mlxformer.errors import MlxformerError
from mlxformer.models.decoder import Model
from mlxformer.sampling.options import check_strings
from mlxformer.text.tokenizer import Tokenizer

__all__ = ["DEFAULT_INSTRUCTION", "rerank", "rerank_inputs", "rerank_tokens", "scorer"]

DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# Qwen3-Reranker's model card: the judging prompt around each "<Instruct>/<Query>/<Document>" body
_PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the '
           'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def rerank_inputs(tokenizer: Tokenizer, query: str, documents: Sequence[str], instruction: str | None = None
                  ) -> list[list[int]]:
    """The token ids of each (query, document) pair in Qwen3-Reranker's template."""
    prefix, suffix = tokenizer.encode(_PREFIX, False), tokenizer.encode(_SUFFIX, False)
    task = instruction or DEFAULT_INSTRUCTION
    return [prefix + tokenizer.encode(f"<Instruct>: {task}\n<Query>: {query}\n<Document>: {document}") + suffix
            for document in documents]


def rerank(model: Model, tokenizer: Tokenizer, query: str, documents: Sequence[str], *,
           instruction: str | None = None, budget: int = BATCH_TOKENS) -> list[float]:
    """The relevance of each document to ``query`` in [0, 1], in the documents' order
    (``rerank_tokens``). ``instruction``: the task ("Given a web search query, ..." by default)."""
    documents = check_strings("documents", documents)
    return rerank_tokens(model, tokenizer, rerank_inputs(tokenizer, query, documents, instruction), budget)


def rerank_tokens(model: Model, tokenizer: Tokenizer, inputs: Sequence[Sequence[int]],
                  budget: int = BATCH_TOKENS) -> list[float]:
    """The relevance in [0, 1] of each (query, document) input (``rerank_inputs``), ``scorer``'s
    score of its last token."""
    return [float(s) for s in pooled_batches(model, inputs, "last", scorer(model, tokenizer), budget)]


def scorer(model: Model, tokenizer: Tokenizer) -> Callable[[mx.array], mx.array]:
    """The relevance ``(B,)`` of last hidden states ``(B, hidden)``: P("yes") against "no" (a
    causal LM), or the ``score`` head's sigmoid (one label; several: the last label's softmax
    share). Raises when the model cannot score."""
    head = model.args.head
    if head == "none":
        raise MlxformerError("this model has no output head to score with (an embedding model?)")
    pick = None
    if head == "lm":
        yes, no = tokenizer.token_to_id("yes"), tokenizer.token_to_id("no")
        if yes is None or no is None:
            raise MlxformerError("this model's vocabulary has no 'yes'/'no' tokens: it is not a Qwen3-Reranker-style model")
        pick = mx.array([no, yes])

    def score(last: mx.array) -> mx.array:
        logits = model.logits(last).astype(mx.float32)
        if pick is not None:
            logits = logits[:, pick]
        if logits.shape[-1] == 1:
            return mx.sigmoid(logits[:, 0])
        return mx.softmax(logits, axis=-1)[:, -1]

    return score
