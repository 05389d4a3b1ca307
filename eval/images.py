"""Image helpers for evaluation and the CLI: tile PIL images into one grid."""

import PIL.Image


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
