"""compressors."""
