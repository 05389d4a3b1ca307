"""The user's cache folder for things mmspec computes once per machine and reuses: `$MMSPEC_CACHE`, or
`~/.cache/mmspec` when it is unset or empty.

What lives there is derived data only (a dequantised SmolLM2 copy, MNIST reference features), each file named by a
fingerprint of everything it was made from, so deleting the folder costs only the time to remake it.
"""

import os
from pathlib import Path


__all__ = ["cache_root"]


def cache_root() -> Path:
    """`$MMSPEC_CACHE`, or `~/.cache/mmspec` (not created here)."""
    return Path(os.environ.get("MMSPEC_CACHE") or Path.home() / ".cache" / "mmspec")
