"""Weight quantization for ``convert -q``.

- ``quantize.py``: affine group quantization in MLX's packed format, the error-minimising scale
  search and the named recipes (per-layer exceptions).
- ``calibration.py``: activation statistics for importance-weighted quantization, from the
  decoder's own forward over a short calibration text."""
