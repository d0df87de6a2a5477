"""Checkpoint formats: hub resolution, safetensors checks and reading, GGUF files and vocabularies, checkpoint streaming."""
