"""The repository stays small enough to clone and to copy to a GPU machine (issue 28): the tracked tree at most
60 MB, `assets/` at most 45 MB, and no tracked file a generated run artefact (checkpoints, pickles)."""

import subprocess
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
TREE_LIMIT, ASSETS_LIMIT = 60e6, 45e6


def tracked_files():
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"not a git checkout ({err})")  # an sdist / installed copy has no tracked tree to measure
    return [ROOT / name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]


def test_tracked_tree_and_assets_fit_their_bars():
    files = tracked_files()
    total = sum(f.stat().st_size for f in files)
    assets = sum(f.stat().st_size for f in files if f.relative_to(ROOT).parts[0] == "assets")
    biggest = sorted(files, key=lambda f: -f.stat().st_size)[:3]
    shown = ", ".join(f"{f.relative_to(ROOT)} {f.stat().st_size / 1e6:.1f} MB" for f in biggest)
    assert total <= TREE_LIMIT, f"tracked tree {total / 1e6:.1f} MB > {TREE_LIMIT / 1e6:.0f} MB (largest: {shown})"
    assert assets <= ASSETS_LIMIT, f"assets/ {assets / 1e6:.1f} MB > {ASSETS_LIMIT / 1e6:.0f} MB (largest: {shown})"


def test_no_pickles_or_checkpoints_are_tracked():
    bad = [f.relative_to(ROOT) for f in tracked_files() if f.suffix in (".pt", ".pth", ".bin", ".ckpt", ".pkl")]
    assert bad == []
