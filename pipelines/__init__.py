"""Diffusers-style speculative pipelines (imported as `mmspec.pipelines`)."""

from .ar_image import SpeculativeARImagePipeline, SpeculativeImageOutput
from .continuous import SpeculativeContinuousARPipeline, SpeculativeContinuousOutput


__all__ = [
    "SpeculativeARImagePipeline",
    "SpeculativeContinuousARPipeline",
    "SpeculativeContinuousOutput",
    "SpeculativeImageOutput",
]
