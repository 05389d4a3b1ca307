"""`Conv(ratio)`: a learned strided convolution, one of the experts of SpecVLM's elastic visual compressor (arXiv
2509.11815: few parameters; it degrades past ~3-5x). A depthwise `s x s` stride-`s` convolution over the image's
square grid, then a pointwise `Linear(dim, dim)`. Initialised to equal `Pool` (depthwise weights 1 / s^2, pointwise
identity, zero biases), so training starts from pooling. Positions as `Pool`: each block's largest.

Images of different sizes (`compress_ragged`): the same blocks as `Pool`'s (each image's own grid, or runs of `s * s`
tokens without one: the kernel's taps in order), zero-padded where an edge block is partial (as a padded
convolution: such a block's output is not the pooled mean at the pooling init).
"""

import torch
from torch import Tensor, nn

from mmspec.compressors.base import ImageBatch, VisionPolicy
from mmspec.compressors.pool import block_positions, blocks_of, grid_blocks, ragged_block_positions
from mmspec.compressors.ragged import RaggedImages, block_index


__all__ = ["Conv"]


class Conv(VisionPolicy):
    """Depthwise strided conv + pointwise linear: `tokens_per_image / ratio` tokens per image,
    `dim * (s * s + 1) + dim * (dim + 1)` parameters."""

    def __init__(self, ratio: int = 4, tokens_per_image: int = 64, dim: int = 576):
        if dim is None:
            raise ValueError("dim is required for Conv (its weights are dim wide)")
        super().__init__(tokens_per_image, dim)
        self.side, self.s = grid_blocks(tokens_per_image, ratio)
        self.ratio = ratio
        self.keep = tokens_per_image // ratio
        s = self.s
        self.depthwise = nn.Conv2d(dim, dim, kernel_size=s, stride=s, groups=dim, device="meta")
        self.pointwise = nn.Linear(dim, dim, device="meta")
        self.depthwise.to_empty(device="cpu")
        self.pointwise.to_empty(device="cpu")
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The pooling init: depthwise 1 / s^2, pointwise identity, zero biases (deterministic, no RNG)."""
        self.depthwise.weight.fill_(1.0 / (self.s * self.s))
        self.depthwise.bias.zero_()
        w = self.pointwise.weight
        w.copy_(torch.eye(self.dim, device=w.device, dtype=w.dtype))
        self.pointwise.bias.zero_()

    def _check(self, tokens: Tensor) -> None:
        weight = self.pointwise.weight
        if tokens.dtype != weight.dtype or tokens.device != weight.device:
            raise TypeError(
                f"image.tokens is {tokens.dtype} on {tokens.device}, Conv's weights {weight.dtype} on "
                f"{weight.device}: move the policy with .to()"
            )

    def kept(self, length: int, grid=None) -> int:
        return blocks_of(length, grid, self.s)

    def compress_ragged(self, images: RaggedImages, generator=None) -> tuple[Tensor, Tensor, None]:
        tokens = images.tokens  # [N, T, dim], zeros on padding
        self._check(tokens)
        n, _, dim = tokens.shape
        block, tap, per_image = block_index(images, self.s, tokens.device)  # [N, T]
        most = max(per_image, default=0)
        taps = self.depthwise.weight.reshape(dim, self.s * self.s).t()  # [s * s, dim] per-channel kernel taps
        weighted = tokens * taps[tap]  # [N, T, dim] each token times its tap's weights (padding: zeros)
        out = tokens.new_zeros(n, most + 1, dim).scatter_add(1, block[..., None].expand(-1, -1, dim), weighted)
        out = self.pointwise(out[:, :most] + self.depthwise.bias)  # [N, K, dim]
        return out, ragged_block_positions(images.positions, block, most), None

    def compress(self, images: ImageBatch, generator=None) -> tuple[Tensor, Tensor, None]:
        tokens = images.tokens  # [N, T, dim]
        self._check(tokens)
        n, _, dim = tokens.shape
        side, b = self.side, self.side // self.s
        grid = tokens.transpose(1, 2).reshape(n, dim, side, side)  # [N, dim, side, side]
        out = self.depthwise(grid) if n else grid.new_zeros(0, dim, b, b)  # [N, dim, b, b]
        out = self.pointwise(out.reshape(n, dim, b * b).transpose(1, 2))  # [N, keep, dim]
        return out, block_positions(images.positions, side, self.s), None
