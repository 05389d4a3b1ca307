"""`Prune(ratio)`: parameter-free token pruning, one of the experts of SpecVLM's elastic visual compressor (arXiv
2509.11815: pruning stays robust up to ~20-30x). Per image the draft keeps `ceil(tokens_per_image / ratio)` tokens:
those most cosine-similar to the question embedding (without a question: the largest L2 norms), in their original
order, each at its own target position. Images of different sizes (`compress_ragged`): `ceil(length / ratio)` each.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from mmspec.compressors.base import ImageBatch, VisionPolicy
from mmspec.compressors.ragged import RaggedImages


__all__ = ["Prune", "check_ratio"]


def check_ratio(ratio) -> float:
    """A compression ratio: a finite real number >= 1 (TypeError / ValueError naming `ratio`)."""
    if isinstance(ratio, bool) or not isinstance(ratio, int | float):
        raise TypeError(f"ratio must be a number, got {type(ratio).__name__}")
    if not math.isfinite(ratio) or ratio < 1:
        raise ValueError(f"ratio must be a finite number >= 1, got {ratio}")
    return ratio


class Prune(VisionPolicy):
    """Keeps the `ceil(tokens_per_image / ratio)` tokens of each image most relevant to the question."""

    def __init__(self, ratio: float = 4, tokens_per_image: int = 64, dim: int | None = None):
        super().__init__(tokens_per_image, dim)
        self.ratio = check_ratio(ratio)
        self.keep = math.ceil(tokens_per_image / self.ratio)

    def compress(self, images: ImageBatch, generator=None) -> tuple[Tensor, Tensor, None]:
        tokens, positions = images.tokens, images.positions  # [N, T, dim], [N, T]
        if images.question is None:
            score = tokens.float().norm(dim=-1)  # [N, T]
        else:
            score = F.cosine_similarity(tokens.float(), images.question.float()[:, None, :], dim=-1)  # [N, T]
        kept = score.topk(self.keep, dim=1).indices.sort(dim=1).values  # [N, keep] original order
        picked = tokens.gather(1, kept[..., None].expand(-1, -1, tokens.shape[2]))  # [N, keep, dim]
        return picked, positions.gather(1, kept), None

    def kept(self, length: int, grid=None) -> int:
        return math.ceil(length / self.ratio)

    def compress_ragged(self, images: RaggedImages, generator=None) -> tuple[Tensor, Tensor, None]:
        tokens, positions, mask = images.tokens, images.positions, images.mask  # [N, T, dim], [N, T], [N, T]
        n, t, dim = tokens.shape
        keep = [self.kept(length) for length in images.lengths]
        most = max(keep, default=0)
        if images.question is None:
            score = tokens.float().norm(dim=-1)  # [N, T]
        else:
            score = F.cosine_similarity(tokens.float(), images.question.float()[:, None, :], dim=-1)  # [N, T]
        score = score.masked_fill(~mask, float("-inf"))  # padding is never among an image's best
        top = score.topk(most, dim=1).indices  # [N, K] best first
        mine = torch.arange(most, device=tokens.device)[None] < torch.tensor(keep, dtype=torch.long,
                                                                            device=tokens.device)[:, None]  # fmt: skip
        kept = torch.where(mine, top, t).sort(dim=1).values.clamp(max=max(t - 1, 0))  # [N, K] image j's first keep_j
        picked = tokens.gather(1, kept[..., None].expand(-1, -1, dim))  # [N, K, dim]
        return picked, positions.gather(1, kept), None
