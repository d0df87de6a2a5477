"""Generating: one sequence's decoding state, prefill and decode steps, the single-stream loop (``stream_generate``/``generate``), chat sessions."""
