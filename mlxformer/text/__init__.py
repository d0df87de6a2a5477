"""Text: tokenizers (tokenizers and sentencepiece backends, sandboxed chat templates), the streaming detokenizer, stop strings."""
