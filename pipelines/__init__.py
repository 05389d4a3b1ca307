"""Diffusers-style speculative pipelines (imported as `mmspec.pipelines`)."""

from .ar_image import SpeculativeARImagePipeline, SpeculativeImageOutput
from .continuous import SpeculativeContinuousARPipeline, SpeculativeContinuousOutput
from .janus import SpeculativeJanusPipeline
from .vlm import SpeculativeVLMOutput, SpeculativeVLMPipeline


__all__ = [
    "SpeculativeARImagePipeline",
    "SpeculativeContinuousARPipeline",
    "SpeculativeContinuousOutput",
    "SpeculativeImageOutput",
    "SpeculativeJanusPipeline",
    "SpeculativeVLMOutput",
    "SpeculativeVLMPipeline",
]
