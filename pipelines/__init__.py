"""Diffusers-style speculative pipelines (imported as `mmspec.pipelines`)."""

from .ar_image import SpeculativeARImagePipeline, SpeculativeImageOutput


__all__ = ["SpeculativeARImagePipeline", "SpeculativeImageOutput"]
