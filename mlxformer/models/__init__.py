"""The one LLaMA-style decoder: every family is a set of ``ModelArgs`` fields, not a file.

- Config: ``config.py`` (the frozen ``ModelArgs``), ``config_bounds.py`` (every size bounded
  before anything is built), ``families.py`` (the ``FAMILIES`` table: each family's config.json
  keys as fields), ``family_keys.py`` (key readers families share), ``gemma4_family.py``,
  ``gpt2_family.py``, ``rope_config.py`` (RoPE settings normalized and written back).
- The decoder: ``decoder.py`` (the model: embedding, layers, a mixer per layer, ``run_layers``),
  ``mask.py`` (the mask type, causal and sliding-window masks), ``norms.py`` (RMSNorm with
  Gemma's offset, LayerNorm, where each layout puts them), ``attention_ops.py`` (soft-capping,
  attention sinks), ``rope.py`` (default, linear, dynamic, llama3, YaRN), ``rope_variants.py``
  (LongRoPE, ``make_rope``).
- Other mixers: ``mla.py`` (multi-head latent attention, absorbed), ``gated_delta.py`` (Gated
  DeltaNet) with ``gated_delta_kernel.py`` (its Metal kernel).
- Feed-forward: ``feed_forward.py`` (the ``MLP_TYPES`` table: which block a layer gets),
  ``mlp.py`` (dense blocks, gate functions), ``moe.py`` (mixture of experts), ``moe_gpt_oss.py``,
  ``router.py`` (DeepSeek/GLM grouped routing), ``expert_counts.py`` (when expert counts are
  read on the host), ``gemma4.py`` (Gemma 4's per-layer inputs and experts block).
- ``mtp.py``: the multi-token-prediction head Qwen3.5/3.6 and Qwen3-Next ship.
- Device policies: ``dtype_policy.py`` (the compute dtype), ``device_plan.py`` (the GPU and CPU
  plans as values), ``row_sharding.py`` (projections split over CPU streams)."""
