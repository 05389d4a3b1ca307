"""Quality of the zoos that a digit classifier does not judge (`mmspec bench ar-image --dataset textures|natural`):
each method's images are scored by FID (Inception pool3, the existing `compute_fid`) against the dataset's held-out
crops (the target's next-token statistics on held-out token grids, `mmspec.eval.entropy.held_out_next_token_stats`,
place the zoo in a method's regime).

The reference statistics are made once by `mmspec eval reference --dataset NAME --features inception` (minutes of
Inception on one CPU core, resumable) and kept under `runs/reference-stats/`: they are not shipped.
"""

import logging
from pathlib import Path

import torch


logger = logging.getLogger(__name__)

REFERENCE_DIR = Path("runs") / "reference-stats"
WORK_DIR = Path("runs") / "reference"


def held_out_reference(dataset: str, out: Path = REFERENCE_DIR, work_dir: Path = WORK_DIR, progress: bool = False):
    """The Inception statistics of `dataset`'s held-out (test) crops, computed once (resumable chunks in `work_dir`)
    and read back from `out` afterwards. Returns `(ReferenceStats, path)`."""
    from mmspec.eval.reference import make_reference, shipped_stats_path
    from mmspec.eval.reference_stats import load_reference_stats

    path = shipped_stats_path("inception", "test", out, dataset=dataset)
    if not path.is_file():
        logger.info("computing the %s reference statistics once: %s", dataset, path)
        make_reference("inception", "test", out, Path("."), work_dir, progress=progress, packed=True,
                       dataset=dataset)  # fmt: skip
    return load_reference_stats(path), path


def method_fids(images: dict[str, list[torch.Tensor]], reference, reference_name: str) -> dict[str, float]:
    """FID of each method's generated images (`{method: [float [B, 1, H, W] in [0, 1], ...]}`) against `reference`."""
    from mmspec.eval.inception import FIDInceptionV3
    from mmspec.eval.metrics import compute_fid

    extractor = FIDInceptionV3()
    return {name: compute_fid(torch.cat(batches).clamp(0, 1), reference, extractor,
                              reference_name=reference_name).fid
            for name, batches in images.items()}  # fmt: skip
