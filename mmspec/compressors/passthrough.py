"""`Passthrough`: the draft reads every image token as is, the raw projector outputs at the target's own positions
(MSD's decoupled drafting: arXiv 2505.14260 feeds `E_img` to the draft at image positions instead of fusing it with
the target's hidden states). No compression: `keep = tokens_per_image`.
"""

from torch import Tensor

from mmspec.compressors.base import ImageBatch, VisionPolicy
from mmspec.compressors.ragged import RaggedImages


__all__ = ["Passthrough"]


class Passthrough(VisionPolicy):
    """Every image token, unchanged, at its own position."""

    def compress(self, images: ImageBatch, generator=None) -> tuple[Tensor, Tensor, None]:
        return images.tokens, images.positions, None  # [N, T, dim], [N, T]

    def compress_ragged(self, images: RaggedImages, generator=None) -> tuple[Tensor, Tensor, None]:
        return images.tokens, images.positions, None  # every image's tokens: its first `length` (`kept`)
