"""Where each image of a VLM prompt sits among its image tokens: `ImageLayout`, one `(length, grid)` per image and
row, known on the host (from the processor's outputs), for targets whose images are not all one fixed size.

A fixed-grid LLaVA turns every image into `image_seq_length` tokens, so a row's image tokens split into images by
counting. Deployed VLMs do not: Qwen2.5-VL / Qwen3-VL turn an image into `t * h * w / merge**2` tokens from its
`image_grid_thw` (a `(t * h / merge) x (w / merge)` grid of merged patches, row-major), and any-resolution LLaVA
(LLaVA-Next, LLaVA-OneVision) into a base tile plus a size-dependent number of unpadded high-resolution tiles with a
newline token per row (the processor knows the count; the tokens do not form one 2-D grid). `image_layout` reads
those facts from the host copies of the prompt, so the draft side (`mmspec.compressors`) can split a row's image
tokens into images with no device read.
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mmspec.models.hf.inputs import image_token_mask


__all__ = ["ImageLayout", "dynamic_image_sizes", "image_layout", "image_runs", "processor_image_layout"]


def dynamic_image_sizes(config) -> bool:
    """The model turns images of different sizes into different numbers of tokens: any-resolution LLaVA
    (`image_grid_pinpoints`: LLaVA-Next, LLaVA-OneVision) or a dynamic-resolution tower (Qwen-VL: a
    `spatial_merge_size` and a `temporal_patch_size`)."""
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return False
    if getattr(config, "image_grid_pinpoints", None):
        return True
    return hasattr(vision, "spatial_merge_size") and hasattr(vision, "temporal_patch_size")


@dataclass(frozen=True)
class ImageLayout:
    """The images of each row, in prompt order (host lists).

    Attributes:
        lengths: `lengths[r][i]` image tokens of row `r`'s image `i` (consecutive in the row's image tokens).
        grids: `grids[r][i]` the `(h, w)` token grid of that image (row-major, `h * w == lengths[r][i]`), or None
            where the tokens do not form one grid (any-resolution tiles) or it is unknown.
    """

    lengths: list[list[int]]
    grids: list[list[tuple[int, int] | None]]

    def __post_init__(self):
        if len(self.lengths) != len(self.grids):
            raise ValueError(f"grids: {len(self.grids)} rows for {len(self.lengths)} rows of lengths")
        for r, (lengths, grids) in enumerate(zip(self.lengths, self.grids, strict=True)):
            if len(lengths) != len(grids):
                raise ValueError(f"grids: row {r} has {len(grids)} grids for {len(lengths)} images")
            for n, grid in zip(lengths, grids, strict=True):
                if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                    raise ValueError(f"lengths: row {r} has an image of {n!r} tokens (an int >= 1 each)")
                if grid is not None and (len(grid) != 2 or min(grid) < 1 or grid[0] * grid[1] != n):
                    raise ValueError(f"grids: row {r}'s grid {grid} does not hold its image's {n} tokens")

    @property
    def counts(self) -> list[int]:
        """Image tokens per row."""
        return [sum(row) for row in self.lengths]

    def uniform(self, tokens_per_image: int) -> bool:
        """Every image is `tokens_per_image` tokens with no grid other than the square one: the fixed-size layout."""
        side = math.isqrt(tokens_per_image)
        square = (side, side) if side * side == tokens_per_image else None
        return all(n == tokens_per_image and g in (None, square) for row, grids in zip(self.lengths, self.grids)
                   for n, g in zip(row, grids))  # fmt: skip


def image_runs(image_mask: Tensor) -> list[list[int]]:
    """The maximal runs of consecutive image tokens per row of a host `[rows, L]` bool mask: one image each where
    images are separated by text (Qwen's `<|vision_start|>` / `<|vision_end|>`); adjacent images merge into one run."""
    runs = []
    for row in image_mask.tolist():
        lengths, n = [], 0
        for flag in row + [False]:
            if flag:
                n += 1
            elif n:
                lengths.append(n)
                n = 0
        runs.append(lengths)
    return runs


def _grid_lengths(model, grid_thw: Tensor) -> tuple[list[int], list[tuple[int, int]]]:
    """Qwen-VL: per image, `t * h * w / merge**2` tokens on a `(t * h / merge, w / merge)` grid (frames stacked)."""
    merge = int(getattr(model.config.vision_config, "spatial_merge_size", 1))
    lengths, grids = [], []
    for t, h, w in grid_thw.tolist():
        grid = (t * (h // merge), w // merge)
        lengths.append(grid[0] * grid[1])
        grids.append(grid)
    return lengths, grids


def image_layout(model, input_ids: Tensor, model_inputs: dict | None = None,
                 image_lengths: list[int] | None = None) -> ImageLayout:  # fmt: skip
    """The `ImageLayout` of a batch of prompts, from host tensors (the processor's outputs before they move).

    Args:
        model: the transformers VLM (its image token id; Qwen-VL's `spatial_merge_size`).
        input_ids: `[rows, L]` the prompts' token ids (host).
        model_inputs: the processor's other outputs; `image_grid_thw` (Qwen-VL) gives every image's length and grid.
        image_lengths: without a grid, the image tokens of every image of the batch in order (e.g. from the
            processor: any-resolution LLaVA); grids unknown.

    Without either, each maximal run of image tokens is one image (`image_runs`; adjacent images merge). Images are
    given to rows in order; ValueError naming `model_inputs` / `image_lengths` where they do not add up to the
    rows' image tokens.
    """
    mask = image_token_mask(model, input_ids)
    counts = mask.sum(1).tolist()
    grid_thw = (model_inputs or {}).get("image_grid_thw")
    if grid_thw is not None:
        lengths, grids, source = *_grid_lengths(model, torch.as_tensor(grid_thw)), "model_inputs['image_grid_thw']"
    elif image_lengths is not None:
        lengths, source = [int(n) for n in image_lengths], "image_lengths"
        grids = [None] * len(lengths)
    else:
        runs = image_runs(mask)
        return ImageLayout(runs, [[None] * len(row) for row in runs])
    rows_lengths, rows_grids, i = [], [], 0
    for r, count in enumerate(counts):
        row, row_grids = [], []
        while sum(row) < count and i < len(lengths):
            row.append(lengths[i])
            row_grids.append(grids[i])
            i += 1
        if sum(row) != count:
            raise ValueError(f"{source}: the images' tokens {row} do not add up to row {r}'s {count} image tokens")
        rows_lengths.append(row)
        rows_grids.append(row_grids)
    if i != len(lengths):
        raise ValueError(f"{source}: {len(lengths) - i} images more than the prompts' image tokens hold")
    return ImageLayout(rows_lengths, rows_grids)


def processor_image_layout(model, processor, input_ids: Tensor, model_inputs: dict) -> ImageLayout | None:
    """The `ImageLayout` of prompts (or whole training rows) `input_ids [rows, L]` from the processor's host outputs
    `model_inputs`, for a target whose images differ in size (`dynamic_image_sizes`); None for a fixed-size target
    (a policy then splits by `tokens_per_image`). Qwen-VL: from `image_grid_thw`; any-resolution LLaVA: the
    processor's count per image (`_get_num_multimodal_tokens` over `image_sizes`); else each run of image tokens is
    one image. What the pipeline and the trainers (`mmspec.train.vlm_vision`) both use."""
    if not dynamic_image_sizes(model.config):
        return None
    lengths = None
    count = getattr(processor, "_get_num_multimodal_tokens", None)
    if "image_grid_thw" not in model_inputs and "image_sizes" in model_inputs and callable(count):
        lengths = list(count(image_sizes=torch.as_tensor(model_inputs["image_sizes"]).tolist()).num_image_tokens)
    return image_layout(model, input_ids, model_inputs, lengths)
