"""Weight quantization for conversion: recipes, the error-minimising group search and calibration."""
