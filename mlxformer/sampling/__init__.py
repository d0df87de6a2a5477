"""Choosing tokens.

- ``options.py``: ``SamplingSettings``, every sampling option, validated once.
- ``model_defaults.py``: a model's own sampling defaults (``generation_config.json``, a GGUF's
  ``general.sampling.*``) and the one rule applying them, for the CLI and the server.
- ``samplers.py``: samplers and logits processors as small pure functions over a batch, the
  accurate ``logsumexp``, the ``TokenConstraint`` protocol.
- ``choosing.py``: ``choose``, one float32 sampling graph for a whole batch (per-row settings
  as vectors, a row's history as a view)."""
