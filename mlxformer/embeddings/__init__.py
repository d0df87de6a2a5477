"""Embeddings and reranking with decoder models.

- ``head.py``: the ``EmbeddingHead`` (pooling, dense projections, normalization) read from the
  checkpoint's sentence-transformers files or a GGUF's pooling type.
- ``encode.py``: ``embed``, padded batches under a token budget, prefill only (no cache).
- ``rerank.py``: ``rerank``, relevance scores from Qwen3-Reranker or a decoder cross-encoder."""
