"""Evaluation: speed benchmarks, FID/IS/CLIP (imported as `mmspec.eval`)."""
