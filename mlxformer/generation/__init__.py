"""Generating: one sequence's decoding state and the loops that drive it.

- ``decoding.py``: ``DecodingState``, one sequence's tokens, caches, sampling, PRNG,
  constraint, stops and speculation (every loop drives it, the engine's too).
- ``steps.py``: the two forward passes, chunked ``prefill`` and ``decode_step``.
- ``stream.py``: the single-stream loop (``decode``: pipelined steps or speculation rounds) and
  ``stream_generate``/``generate``.
- ``chat.py``: ``ChatSession``, a multi-turn chat that keeps the KV cache between turns.
- ``prompt_cache_files.py``: a prefilled KV cache saved to safetensors and loaded back
  checked (the fingerprint of the model and tokenizer that made it)."""
