"""Image helpers for evaluation and the CLI: tile PIL images into one grid; image tensors to float [0, 1]."""

import PIL.Image
import torch


def make_grid(images, ncols):
    """Tile equally sized PIL images row-major into one image with `ncols` columns (2 px black gutters)."""
    if not images:
        raise ValueError("images must be a non-empty list of PIL images")
    if ncols < 1:
        raise ValueError(f"ncols must be >= 1, got {ncols}")
    w, h = images[0].size
    nrows = -(-len(images) // ncols)
    pad = 2
    grid = PIL.Image.new(images[0].mode, (ncols * (w + pad) + pad, nrows * (h + pad) + pad))
    for i, img in enumerate(images):
        r, c = divmod(i, ncols)
        grid.paste(img, (pad + c * (w + pad), pad + r * (h + pad)))
    return grid


def to_unit_float(images: torch.Tensor, name: str = "images") -> torch.Tensor:
    """uint8 [0, 255] or float [0, 1] grayscale [N, 1, H, W] -> float32 [0, 1]."""
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [N, 1, H, W], got {type(images).__name__}")
    if images.dim() != 4 or images.shape[1] != 1 or images.shape[0] == 0:
        raise ValueError(f"{name} must have shape [N, 1, H, W] with N >= 1 (grayscale), got {tuple(images.shape)}")
    if images.dtype == torch.uint8:
        return images.float() / 255
    if not images.is_floating_point():
        raise TypeError(f"{name} must be uint8 in [0, 255] or float in [0, 1], got dtype {images.dtype}")
    lo, hi = float(images.min()), float(images.max())
    if lo < 0.0 or hi > 1.0:
        raise ValueError(
            f"float {name} must lie in [0, 1] (MNIST data in [-1, 1]: use (x + 1) / 2), got [{lo:.4g}, {hi:.4g}]"
        )
    return images.float()
