"""Images of different sizes on the draft side: a row's image tokens cut into images by their actual lengths (an
`mmspec.models.hf.image_layout.ImageLayout`, host-known from the processor), each image padded to the longest with a
key mask (`RaggedImages`), and the policies' per-image outputs packed back into rows.

Used by `VisionPolicy.forward` when a batch's layout is not the fixed one (every image `tokens_per_image` tokens on
a square grid: LLaVA), e.g. Qwen-VL's dynamic grids or any-resolution LLaVA's tiles. Every shape and index here is
built on the host from the layout, so splitting and packing need no device read.

Pool / conv experts work on blocks of an image's 2-D token grid (`grid_blocks_ragged`): `s x s` blocks
(`s * s = ratio`) of the image's `(h, w)` grid, partial at its bottom / right edge where `s` does not divide it; an
image without a known grid (any-resolution tiles: base tile + unpadded tiles + newline tokens) falls back to runs of
`ratio` consecutive tokens (a `1 x n` strip cut into `1 x ratio` blocks, the kernel's `s * s` taps in order).
"""

import math
from typing import NamedTuple

import torch
from torch import Tensor

from mmspec.models.hf.image_layout import ImageLayout


__all__ = ["RaggedImages", "block_index", "grid_blocks_ragged", "pack_ragged", "split_ragged"]


class RaggedImages(NamedTuple):
    """Every image of a batch on its own, padded to the longest (what `VisionPolicy.compress_ragged` works on)."""

    tokens: Tensor  # [N, T, dim]  N = images over all rows, T = the longest image; zeros on padding
    positions: Tensor  # [N, T] long  target positions (0 on padding)
    mask: Tensor  # [N, T] bool  True on the image's own tokens (a prefix)
    question: Tensor | None  # [N, dim]  the question of each image's row
    lengths: list[int]  # [N] tokens per image (host)
    grids: list[tuple[int, int] | None]  # [N] each image's (h, w) token grid, None: unknown (host)
    images: list[int]  # images per row (host)


def split_ragged(tokens: Tensor, positions: Tensor, question: Tensor | None, layout: ImageLayout) -> RaggedImages:
    """`tokens [rows, M, dim]` / `positions [rows, M]` (each row's image tokens left-packed, in order) cut into the
    layout's images, padded to the longest image. One host-built index, no device read."""
    rows, most, dim = tokens.shape
    lengths = [n for row in layout.lengths for n in row]
    grids = [g for row in layout.grids for g in row]
    images = [len(row) for row in layout.lengths]
    longest = max(lengths, default=0)
    index, mask, owner = [], [], []
    for r, row in enumerate(layout.lengths):
        start = 0
        for n in row:
            index += [r * most + start + j for j in range(n)] + [r * most] * (longest - n)
            mask += [True] * n + [False] * (longest - n)
            owner.append(r)
            start += n
    device = tokens.device
    index_t = torch.tensor(index, dtype=torch.long, device=device)
    mask_t = torch.tensor(mask, dtype=torch.bool, device=device).reshape(len(lengths), longest)
    out = tokens.reshape(rows * most, dim).index_select(0, index_t).reshape(len(lengths), longest, dim)
    pos = positions.reshape(rows * most).index_select(0, index_t).reshape(len(lengths), longest)
    per_image = None
    if question is not None:
        per_image = question.index_select(0, torch.tensor(owner, dtype=torch.long, device=device))  # [N, dim]
    return RaggedImages(out.masked_fill(~mask_t[..., None], 0.0), pos.masked_fill(~mask_t, 0), mask_t, per_image,
                        lengths, grids, images)  # fmt: skip


def pack_ragged(batch: RaggedImages, tokens: Tensor, positions: Tensor, global_vec: Tensor | None,
                kept: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor | None, list[int]]:  # fmt: skip
    """Per-image outputs (`tokens [N, K, dim]`, `positions [N, K]`: image `j`'s first `kept[j]` are its own) back
    into rows, left-packed in image order: `(tokens [rows, M, dim], positions [rows, M], valid [rows, M],
    global_vec [rows, dim] | None` (the row's last image's; zeros without image), `counts` per row on the host)."""
    n_images, k, dim = tokens.shape
    if len(kept) != n_images or any(not 0 <= c <= k for c in kept):
        raise ValueError(f"kept: {kept} does not fit {n_images} images of {k} outputs")
    rows = len(batch.images)
    per_row, last, j = [], [], 0
    for n in batch.images:
        per_row.append([i * k + q for i in range(j, j + n) for q in range(kept[i])])
        last.append(j + n - 1 if n else n_images)  # n_images: a zero row
        j += n
    counts = [len(ix) for ix in per_row]
    most = max(counts, default=0)
    device = tokens.device
    index = torch.tensor([i for ix in per_row for i in ix + [0] * (most - len(ix))], dtype=torch.long, device=device)
    valid = torch.tensor([[q < c for q in range(most)] for c in counts], dtype=torch.bool,
                         device=device).reshape(rows, most)  # fmt: skip
    if most:
        out = tokens.reshape(n_images * k, dim).index_select(0, index).reshape(rows, most, dim)
        pos = positions.reshape(n_images * k).index_select(0, index).reshape(rows, most)
    else:
        out, pos = tokens.new_zeros(rows, 0, dim), positions.new_zeros(rows, 0)
    row_global = None
    if global_vec is not None:
        padded = torch.cat([global_vec, global_vec.new_zeros(1, dim)])
        row_global = padded.index_select(0, torch.tensor(last, dtype=torch.long, device=device))  # [rows, dim]
    return out.masked_fill(~valid[..., None], 0.0), pos.masked_fill(~valid, 0), valid, row_global, counts


def grid_blocks_ragged(length: int, grid: tuple[int, int] | None, s: int) -> tuple[list[int], list[int], int]:
    """Blocks of one image for pool / conv: `(block of each token, kernel tap of each token, number of blocks)`.
    With a grid `(h, w)`: `s x s` blocks of the row-major grid, row-major, `ceil(h / s) * ceil(w / s)` of them (the
    last row / column of blocks partial), tap `(i % s) * s + j % s`. Without (None): runs of `s * s` consecutive
    tokens, `ceil(length / s**2)` blocks, tap `t % s**2`."""
    if grid is None:
        r = s * s
        return [t // r for t in range(length)], [t % r for t in range(length)], math.ceil(length / r)
    h, w = grid
    if h * w != length:
        raise ValueError(f"grid {grid} does not hold the image's {length} tokens")
    across = math.ceil(w / s)
    blocks = [(t // w) // s * across + (t % w) // s for t in range(length)]
    taps = [(t // w) % s * s + (t % w) % s for t in range(length)]
    return blocks, taps, math.ceil(h / s) * across


def block_index(batch: RaggedImages, s: int, device) -> tuple[Tensor, Tensor, list[int]]:
    """`(block [N, T], tap [N, T], blocks per image)` for `grid_blocks_ragged` over a batch; padding tokens go to
    block `K` (one past the most blocks of an image: a dump column) and tap 0."""
    per_image = [grid_blocks_ragged(n, g, s) for n, g in zip(batch.lengths, batch.grids, strict=True)]
    longest = batch.tokens.shape[1]
    dump = max((b for _, _, b in per_image), default=0)
    block = [b + [dump] * (longest - len(b)) for b, _, _ in per_image]
    tap = [t + [0] * (longest - len(t)) for _, t, _ in per_image]
    shape = (len(per_image), longest)
    return (torch.tensor(block, dtype=torch.long, device=device).reshape(shape),
            torch.tensor(tap, dtype=torch.long, device=device).reshape(shape), [b for _, _, b in per_image])  # fmt: skip
