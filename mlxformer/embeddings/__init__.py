"""Embeddings and reranking with decoder models: ``head`` (pooling and projections read from
the checkpoint), ``encode`` (batched forwards, no cache), ``rerank`` (relevance scores)."""
