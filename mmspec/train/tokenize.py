"""Encode an image dataset with a trained VQ into token grids: `python -m mmspec.train tokenize --vq assets/mnist-vq
--out runs/mnist-codes.pt` (MNIST), or `--dataset textures --vq assets/texture-vq --out runs/texture-codes.pt`.

The output is a torch file (load with `load_codes` or `torch.load(path, weights_only=True)`) holding a dict:

    codes        int16 [N, h*w]   code ids in raster order (int16 holds codebook sizes up to 32768; use `.long()`)
    labels       int64 [N]        class labels (digits; texture classes)
    split        int64 [N]        index into `splits` for every row
    splits       list[str]        split names in row order, e.g. ["train", "val", "test"]
    split_ranges dict[str, [start, stop]]   rows of each split (contiguous, in `splits` order)
    grid         [h, w]           token grid (8x8 for assets/mnist-vq, 16x16 for assets/texture-vq)
    dataset      str              the image dataset (`mmspec.data.datasets`)
    codebook_size int
    vq           str              the VQ folder used
    vq_sha256    str              sha256 of the VQ weights file (to detect stale token files)

Examples:
    >>> from mmspec.train.tokenize import load_codes
    >>> codes, labels = load_codes("runs/mnist-codes.pt", split="train+val")  # int64 [60000, 64], int64 [60000]
"""

import hashlib
import logging
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mmspec.cli.args import int_in_range, non_negative_int
from mmspec.data.datasets import load_images
from mmspec.train.common import (
    MAX_STEPS,
    MAX_THREADS,
    add_dataset_argument,
    configure_threads,
    declare_paths,
    mnist_splits,
    save_checkpoint,
    size_int,
    zoo_folder,
)


logger = logging.getLogger(__name__)


def add_arguments(parser):
    parser.add_argument("--vq", default=zoo_folder("mnist-vq"), help="VQ model folder")
    parser.add_argument("--out", default="runs/mnist-codes.pt", help="output torch file")
    add_dataset_argument(parser)
    parser.add_argument("--splits", type=mnist_splits, default="train+val+test", help="'+'-joined splits")
    declare_paths(parser, model_folders=("vq",), output_files=("out",))
    parser.add_argument("--batch-size", type=size_int, default=500, help="encoding batch size")
    parser.add_argument(
        "--steps",
        type=int_in_range(0, MAX_STEPS),
        default=0,
        help="unused (tokenizing is deterministic); for CLI symmetry",
    )
    parser.add_argument(
        "--seed", type=non_negative_int, default=0, help="unused (tokenizing is deterministic); for CLI symmetry"
    )
    parser.add_argument(
        "--threads", type=int_in_range(0, MAX_THREADS), default=2, help="torch CPU threads (0: torch's default)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _weights_sha256(folder: Path) -> str:
    files = sorted(folder.glob("*.safetensors"))
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.read_bytes())
    return digest.hexdigest()


@torch.no_grad()
def encode_images(vq, images: torch.Tensor, batch_size: int = 500, progress=None) -> torch.Tensor:
    """Encode images [N, C, H, W] in [-1, 1] with `vq` -> int64 codes [N, h*w] (raster order); `progress`: an
    optional tqdm bar advanced by the images encoded."""
    vq.eval()
    codes = []
    for i in range(0, len(images), batch_size):
        codes.append(vq.encode(images[i : i + batch_size]))
        if progress is not None:
            progress.update(len(codes[-1]))
    return torch.cat(codes)


def load_codes(path, split: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Read a tokenized-images file -> (codes int64 [N, h*w], labels int64 [N]), optionally for "+"-joined splits.

    Raises:
        ValueError: unreadable file or unknown split name.
    """
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(f"cannot read tokenized data {str(path)!r}: {err}") from err
    codes, labels = data["codes"].long(), data["labels"].long()
    if split is None:
        return codes, labels
    rows = []
    for name in split.split("+"):
        if name not in data["split_ranges"]:
            raise ValueError(f"split {name!r} not in {str(path)!r}; it holds {data['splits']}")
        start, stop = data["split_ranges"][name]
        rows.append(torch.arange(start, stop))
    rows = torch.cat(rows)
    return codes[rows], labels[rows]


def run(args):
    from mmspec.models import load

    configure_threads(args.threads)
    vq = load(args.vq)
    names = args.splits.split("+")
    codes, labels, split_ids, ranges, start = [], [], [], {}, 0
    bar = tqdm(unit="image", disable=getattr(args, "quiet", False))
    for i, name in enumerate(names):
        images, split_labels = load_images(args.dataset, name)
        bar.set_description(name)
        bar.total = (bar.total or 0) + len(images)
        split_codes = encode_images(vq, images, args.batch_size, progress=bar)
        codes.append(split_codes)
        labels.append(split_labels)
        split_ids.append(torch.full((len(split_labels),), i, dtype=torch.long))
        ranges[name] = [start, start + len(split_labels)]
        start += len(split_labels)
        logger.info("encoded %s: %s", name, tuple(split_codes.shape))
    bar.close()
    codes = torch.cat(codes)
    dtype = torch.int16 if vq.config.codebook_size <= 2**15 else torch.int64
    h, w = vq.token_grid(codes.shape[1])
    data = {
        "codes": codes.to(dtype),
        "labels": torch.cat(labels),
        "split": torch.cat(split_ids),
        "splits": names,
        "split_ranges": ranges,
        "grid": [h, w],
        "dataset": args.dataset,
        "codebook_size": int(vq.config.codebook_size),
        "vq": str(args.vq),
        "vq_sha256": _weights_sha256(Path(args.vq)),
    }
    save_checkpoint(args.out, data)
    hist = torch.bincount(codes.flatten(), minlength=vq.config.codebook_size)
    logger.info(
        "wrote %s: codes %s %s, %d/%d codes used",
        args.out,
        tuple(codes.shape),
        dtype,
        int((hist > 0).sum()),
        len(hist),
    )
