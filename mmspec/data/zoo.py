"""Where the shipped zoo lives (no torch import: the CLI reads it before anything loads)."""

from pathlib import Path


__all__ = ["DEFAULT_ZOO"]

# the shipped zoo (the repo's assets/): the default root of every `from_zoo` and every command's `--zoo`, wherever
# the caller runs from
DEFAULT_ZOO = Path(__file__).resolve().parents[2] / "assets"
