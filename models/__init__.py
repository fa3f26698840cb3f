"""Model definitions, sources, INT4 quantization and export (ONNX now, TVM next)."""
