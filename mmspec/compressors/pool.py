"""`Pool(ratio)`: parameter-free spatial average pooling, one of the experts of SpecVLM's elastic visual compressor
(arXiv 2509.11815: pooling stays robust up to ~20-30x). An image's tokens form a square grid (`side =
sqrt(tokens_per_image)`, row-major: LLaVA's patch order); each `s x s` block (`s = sqrt(ratio)`) becomes its mean.
The block's token takes the largest target position in its block, so it sits inside the image span and after
everything it summarises (the draft's causal attention never sees a summary before its parts).

Images of different sizes (`compress_ragged`): `s x s` blocks of each image's own `(h, w)` grid, the edge blocks
partial (their mean over the tokens they hold); without a known grid, runs of `ratio` consecutive tokens
(`mmspec.compressors.ragged.grid_blocks_ragged`).
"""

import math

from torch import Tensor

from mmspec.compressors.base import ImageBatch, VisionPolicy
from mmspec.compressors.ragged import RaggedImages, block_index


__all__ = ["Pool", "block_positions", "blocks_of", "grid_blocks", "ragged_block_positions"]


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


def blocks_of(length: int, grid: tuple[int, int] | None, s: int) -> int:
    """Blocks of one image (`grid_blocks_ragged`'s count): `ceil(h / s) * ceil(w / s)`, or `ceil(length / s**2)`
    without a grid."""
    if grid is None:
        return math.ceil(length / (s * s))
    return math.ceil(grid[0] / s) * math.ceil(grid[1] / s)


def ragged_block_positions(positions: Tensor, block: Tensor, blocks: int) -> Tensor:
    """`positions [N, T]`, `block [N, T]` (padding in block `blocks`) -> `[N, blocks]` each block's largest
    position (positions are >= 0)."""
    out = positions.new_zeros(positions.shape[0], blocks + 1)
    return out.scatter_reduce(1, block, positions, reduce="amax", include_self=True)[:, :blocks]


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

    def kept(self, length: int, grid=None) -> int:
        return blocks_of(length, grid, self.s)

    def compress_ragged(self, images: RaggedImages, generator=None) -> tuple[Tensor, Tensor, None]:
        tokens = images.tokens  # [N, T, dim], zeros on padding
        n, _, dim = tokens.shape
        block, _, per_image = block_index(images, self.s, tokens.device)  # [N, T]
        most = max(per_image, default=0)
        sums = tokens.new_zeros(n, most + 1, dim).scatter_add(1, block[..., None].expand(-1, -1, dim), tokens)
        sizes = tokens.new_zeros(n, most + 1).scatter_add(1, block, images.mask.to(tokens.dtype))  # tokens per block
        pooled = sums[:, :most] / sizes[:, :most, None].clamp(min=1)  # [N, K, dim]
        return pooled, ragged_block_positions(images.positions, block, most), None
