"""Tools over a model.

- ``converter.py``: ``convert``, an HF/MLX dir, hub repo or GGUF file to an mlx-lm compatible
  MLX dir, optionally quantized.
- ``perplexity.py``: sliding-window perplexity on a text file.
- ``bench.py``: prefill and decode throughput and peak memory on random prompts.
- ``planning.py``: what a model needs (parameters, weight and KV memory, machines) from its
  config and tensor headers only: ``mlxformer info``."""
