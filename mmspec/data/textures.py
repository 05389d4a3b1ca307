"""Textile textures from the `conformal-clip-data` package (2,000 greyscale 250×250 JPEGs), offline: the high-entropy
image zoo's data.

Each image gives 9 non-overlapping centred crops of 64×64 pixels at full resolution (a VQ with downsample 4 turns a
crop into a 16×16 = 256-token grid). Images, not crops, are split, so no held-out crop shares an image with a training
crop: in every class, image `i` goes to "test" when `i % 10 == 0`, to "val" when `i % 10 == 5`, else to "train"
(1,600 / 200 / 200 images; 14,400 / 1,800 / 1,800 crops).

Classes: 0 for the package's `nominal` and `local` images (a local defect covers a few pixels, so nearly all of its
crops are nominal texture), 1 for its `global` images (a finer, lower-contrast weave everywhere).

Examples:
    >>> from mmspec.data.textures import load_textures
    >>> images, labels = load_textures("test")  # float32 [1800, 1, 64, 64] in [-1, 1], int64 [1800]
"""

import importlib.util
import logging
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch


logger = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
INSTALL_HINT = "pip install -c constraints.txt --no-deps conformal-clip-data==0.1.4"
CROP = 64  # crop side in pixels
PER_SIDE = 3  # crops per image side (3 x 3 = 9 per image)
# the package's folders, in class order (nominal and local share class 0)
FOLDERS = (("nominal", 0), ("local", 0), ("global", 1))
CLASS_NAMES = ("nominal", "global-defect")


def textures_root() -> Path:
    """The `simulated` folder of textile JPEGs inside the installed `conformal-clip-data` (found without importing it).

    Raises:
        ImportError: the package is not installed (the message says how to install it).
    """
    spec = importlib.util.find_spec("conformal_clip_data")
    for location in list(spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(location) / "data" / "textile_images" / "simulated"
        if all((path / name).is_dir() for name, _ in FOLDERS):
            return path
    raise ImportError(
        "texture data not found: the `conformal-clip-data` package (which ships the textile JPEGs) is not installed. "
        f"Install it with `{INSTALL_HINT}`."
    )


def is_textures_available() -> bool:
    """True when `conformal-clip-data` is installed with its images."""
    try:
        textures_root()
    except ImportError:
        return False
    return True


def split_of(index: int) -> str:
    """The split of the `index`-th image (in file-name order) of a class folder."""
    return {0: "test", 5: "val"}.get(index % 10, "train")


def crops_of(image: np.ndarray) -> np.ndarray:
    """uint8 [H, W] -> the `PER_SIDE`² centred, non-overlapping `CROP`-pixel crops, [PER_SIDE², CROP, CROP] in raster
    order.

    Raises:
        ValueError: the image is smaller than `PER_SIDE * CROP` on a side.
    """
    span = PER_SIDE * CROP
    h, w = image.shape
    if h < span or w < span:
        raise ValueError(f"a texture image of {h}x{w} pixels is smaller than {span}x{span}")
    top, left = (h - span) // 2, (w - span) // 2
    grid = image[top : top + span, left : left + span].reshape(PER_SIDE, CROP, PER_SIDE, CROP)
    return grid.transpose(0, 2, 1, 3).reshape(PER_SIDE * PER_SIDE, CROP, CROP)


@lru_cache(maxsize=2)
def _load_split(root: str, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    from PIL import Image

    crops, labels = [], []
    for folder, label in FOLDERS:
        files = sorted(p for p in (Path(root) / folder).iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
        for index, path in enumerate(files):
            if split_of(index) != split:
                continue
            with Image.open(path) as image:
                pixels = np.asarray(image.convert("L"))
            crops.append(crops_of(pixels))
            labels += [label] * PER_SIDE * PER_SIDE
    images = torch.from_numpy(np.concatenate(crops)).unsqueeze(1).float().div_(127.5).sub_(1.0)
    return images, torch.tensor(labels, dtype=torch.long)


def load_textures(split: str = "train", root: str | Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Texture crops of one split (or several joined with "+", concatenated in that order).

    Args:
        split: "train", "val", "test", or a "+"-joined combination.
        root: a folder with `nominal/`, `local/` and `global/` image folders (default: the installed package's).

    Returns:
        (images float32 [N, 1, 64, 64] in [-1, 1], labels int64 [N] in {0, 1}).

    Raises:
        ValueError: unknown split name.
        ImportError: `conformal-clip-data` is not installed (and no `root` was given).
    """
    names = split.split("+")
    for name in names:
        if name not in SPLITS:
            raise ValueError(f"split={split!r}: unknown part {name!r}; use one of {SPLITS} joined with '+'")
    base = str(Path(root) if root is not None else textures_root())
    parts = [_load_split(base, name) for name in names]
    images = torch.cat([p[0] for p in parts])
    labels = torch.cat([p[1] for p in parts])
    logger.debug("loaded textures %s: %s", split, tuple(images.shape))
    return images, labels
