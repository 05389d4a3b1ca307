"""`Pool(ratio)`: parameter-free spatial average pooling, one of the experts of SpecVLM's elastic visual compressor
(arXiv 2509.11815: pooling stays robust up to ~20-30x). An image's tokens form a square grid (`side =
sqrt(tokens_per_image)`, row-major: LLaVA's patch order); each `s x s` block (`s = sqrt(ratio)`) becomes its mean.
The block's token takes the largest target position in its block, so it sits inside the image span and after
everything it summarises (the draft's causal attention never sees a summary before its parts).
"""

import math

from torch import Tensor

from mmspec.compressors.base import ImageBatch, VisionPolicy


__all__ = ["Pool", "block_positions", "grid_blocks"]


def grid_blocks(tokens_per_image: int, ratio) -> tuple[int, int]:
    """`(side, s)` of a square grid of `tokens_per_image` cut into `s x s` blocks, `s * s = ratio`: ValueError naming
    `tokens_per_image` (not a square) or `ratio` (not a square whose root divides the side)."""
    if isinstance(ratio, bool) or not isinstance(ratio, int):
        raise TypeError(f"ratio must be an int (a square), got {type(ratio).__name__}")
    side = math.isqrt(tokens_per_image)
    if side * side != tokens_per_image:
        raise ValueError(f"tokens_per_image must be a square (a side x side grid) for pooling, got {tokens_per_image}")
    s = math.isqrt(ratio) if ratio >= 1 else 0
    if ratio < 1 or s * s != ratio or side % s:
        raise ValueError(
            f"ratio must be a square whose root divides the grid side {side} (tokens_per_image={tokens_per_image}), "
            f"got {ratio}"
        )
    return side, s


def block_positions(positions: Tensor, side: int, s: int) -> Tensor:
    """`positions [N, side * side]` (row-major grid) -> `[N, (side / s) ** 2]`: each block's largest position, blocks
    row-major (strictly increasing when the grid's positions are)."""
    n, b = positions.shape[0], side // s
    blocks = positions.reshape(n, b, s, b, s)  # [N, block row, row in block, block col, col in block]
    return blocks.amax(dim=(2, 4)).reshape(n, b * b)


class Pool(VisionPolicy):
    """Mean of each `s x s` block of the image grid: `tokens_per_image / ratio` tokens per image."""

    def __init__(self, ratio: int = 4, tokens_per_image: int = 64, dim: int | None = None):
        super().__init__(tokens_per_image, dim)
        self.side, self.s = grid_blocks(tokens_per_image, ratio)
        self.ratio = ratio
        self.keep = tokens_per_image // ratio

    def compress(self, images: ImageBatch, generator=None) -> tuple[Tensor, Tensor, None]:
        tokens = images.tokens  # [N, T, dim]
        n, _, dim = tokens.shape
        b, s = self.side // self.s, self.s
        pooled = tokens.reshape(n, b, s, b, s, dim).mean(dim=(2, 4)).reshape(n, b * b, dim)  # [N, keep, dim]
        return pooled, block_positions(images.positions, self.side, s), None
