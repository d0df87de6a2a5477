"""The one LLaMA-style decoder: its frozen config, RoPE, attention masks and the CPU row sharding."""
