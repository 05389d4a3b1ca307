"""Natural greyscale images from scikit-image's bundled samples, offline: the data of the natural-image zoo, the one
image zoo in the regime SJD-PAC and SCD were made for (plain SJD stalls at 2.7x step compression where SJD + SCD
reaches 3.8x: `docs/benchmarks.md`).

scikit-image ships a few photographs and micrographs inside its wheel (`skimage.data`, no download). Each of
`IMAGES` is turned grey, then seen at two scales: full resolution (class 0) and halved by box filtering (class 1, a
zoomed-out view). Each scaled image is cut into non-overlapping `BLOCK`-pixel blocks in raster order, and blocks, not
crops, are split, so no held-out crop shares a pixel with a training crop: block `k` of a scaled image goes to
"test" when `k % 10 == 0`, to "val" when `k % 10 == 5`, else to "train".

- train: every `CROP`-pixel window inside a training block at a stride of `TRAIN_STRIDE` pixels (81 per block);
- val / test: the 4 non-overlapping `CROP`-pixel tiles of each held-out block.

A VQ with downsample 2 turns a 32x32 crop into a 16x16 = 256-token grid.

Examples:
    >>> from mmspec.data.natural import load_natural
    >>> images, labels = load_natural("test")  # float32 [N, 1, 32, 32] in [-1, 1], int64 [N] (the scale class)
"""

import importlib.util
import logging
from functools import lru_cache

import numpy as np
import torch


logger = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
INSTALL_HINT = "pip install -c constraints.txt scikit-image==0.26.0"
# skimage.data images that load without a download (greyscale or RGB); documents, binary and synthetic images, and
# the mostly black retina / deep-field images are left out
IMAGES = ("astronaut", "brick", "camera", "chelsea", "clock", "coffee", "coins", "grass", "gravel",
          "immunohistochemistry", "moon", "rocket")  # fmt: skip
SCALES = (1, 2)  # class c: the image downscaled by SCALES[c] (box filter)
CLASS_NAMES = ("full resolution", "half resolution")
BLOCK = 64  # side of the blocks that are split
CROP = 32  # crop side in pixels
TRAIN_STRIDE = 4  # training crops: every CROP window of a training block at this stride


def is_natural_available() -> bool:
    """True when scikit-image (which bundles the sample images) is installed."""
    return importlib.util.find_spec("skimage") is not None


def split_of(block: int) -> str:
    """The split of the `block`-th block (raster order) of a scaled image."""
    return {0: "test", 5: "val"}.get(block % 10, "train")


def grey(image: np.ndarray) -> np.ndarray:
    """An RGB(A) or grey uint8 image -> float32 grey [H, W] in [0, 255] (ITU-R 601 luma)."""
    image = np.asarray(image)
    if image.ndim == 3:
        return image[..., :3].astype(np.float32) @ np.array([0.299, 0.587, 0.114], dtype=np.float32)
    return image.astype(np.float32)


def downscale(image: np.ndarray, factor: int) -> np.ndarray:
    """Box-filter downscaling of a grey image [H, W] by an integer `factor` (edges that do not fill a box dropped)."""
    if factor == 1:
        return image
    h, w = image.shape[0] // factor, image.shape[1] // factor
    return image[: h * factor, : w * factor].reshape(h, factor, w, factor).mean(axis=(1, 3))


def blocks_of(image: np.ndarray) -> list[np.ndarray]:
    """The non-overlapping `BLOCK`-pixel blocks of a grey image in raster order (a remainder at the right and bottom
    edges is dropped)."""
    rows, cols = image.shape[0] // BLOCK, image.shape[1] // BLOCK
    return [image[r * BLOCK : (r + 1) * BLOCK, c * BLOCK : (c + 1) * BLOCK] for r in range(rows) for c in range(cols)]


def crops_of_block(block: np.ndarray, split: str) -> np.ndarray:
    """[n, CROP, CROP] crops of one block: every window at `TRAIN_STRIDE` for "train", the 4 tiles otherwise."""
    stride = TRAIN_STRIDE if split == "train" else CROP
    starts = range(0, BLOCK - CROP + 1, stride)
    return np.stack([block[y : y + CROP, x : x + CROP] for y in starts for x in starts])


def _sample_images() -> dict[str, np.ndarray]:
    if not is_natural_available():
        raise ImportError(
            f"natural images not found: scikit-image is not installed. Install it with `{INSTALL_HINT}`."
        )
    import skimage.data

    return {name: grey(getattr(skimage.data, name)()) for name in IMAGES}


@lru_cache(maxsize=2)
def _load_split(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    crops, labels = [], []
    for image in _sample_images().values():
        for label, factor in enumerate(SCALES):
            for k, block in enumerate(blocks_of(downscale(image, factor))):
                if split_of(k) == split:
                    tiles = crops_of_block(block, split)
                    crops.append(tiles)
                    labels += [label] * len(tiles)
    images = torch.from_numpy(np.concatenate(crops)).unsqueeze(1).float().div_(127.5).sub_(1.0)
    return images, torch.tensor(labels, dtype=torch.long)


def load_natural(split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """Natural-image crops of one split (or several joined with "+", concatenated in that order).

    Args:
        split: "train", "val", "test", or a "+"-joined combination.

    Returns:
        (images float32 [N, 1, 32, 32] in [-1, 1], labels int64 [N]: 0 full resolution, 1 half resolution).

    Raises:
        ValueError: unknown split name.
        ImportError: scikit-image is not installed.
    """
    names = split.split("+")
    for name in names:
        if name not in SPLITS:
            raise ValueError(f"split={split!r}: unknown part {name!r}; use one of {SPLITS} joined with '+'")
    parts = [_load_split(name) for name in names]
    images = torch.cat([p[0] for p in parts])
    labels = torch.cat([p[1] for p in parts])
    logger.debug("loaded natural images %s: %s", split, tuple(images.shape))
    return images, labels
