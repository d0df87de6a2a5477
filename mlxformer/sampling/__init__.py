"""Choosing tokens: the sampling options and their one validation, a model's sampling defaults, samplers and logits processors, the batched sampling graph."""
