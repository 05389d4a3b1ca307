"""`TextOnly`: the draft drops every image token (M = 0) and drafts from the text alone — SpecVLM's text-only
branch of the elastic compressor (arXiv 2509.11815), also the "drop" policy of a text-only draft.
"""

import torch
from torch import Tensor

from mmspec.compressors.base import ImageBatch, VisionPolicy
from mmspec.compressors.ragged import RaggedImages


__all__ = ["TextOnly"]


class TextOnly(VisionPolicy):
    """No image token survives: `keep = 0`."""

    def __init__(self, tokens_per_image: int = 64, dim: int | None = None):
        super().__init__(tokens_per_image, dim)
        self.keep = 0

    def kept(self, length: int, grid=None) -> int:
        return 0

    def compress_ragged(self, images: RaggedImages, generator=None) -> tuple[Tensor, Tensor, None]:
        return self.compress(images, generator)

    def compress(self, images: ImageBatch | RaggedImages, generator=None) -> tuple[Tensor, Tensor, None]:
        n, _, dim = images.tokens.shape
        empty = images.tokens.new_zeros(n, 0, dim)  # [N, 0, dim]
        return empty, torch.zeros(n, 0, dtype=torch.long, device=empty.device), None
