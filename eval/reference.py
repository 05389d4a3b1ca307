"""`mmspec eval reference`: reference statistics of real images for FID (MNIST, or the held-out crops of the
natural-image and texture zoos with `--dataset natural|textures`), written in the ADM `.npz` layout.

The shipped files in `assets/reference-stats/` were made by

    mmspec eval reference --split test --features in-domain,inception --out assets/reference-stats --packed

and the Inception file was then stored with float16 covariance (`save_reference_stats(..., dtype="float16",
packed=True)` of the same statistics, what `--dtype float16` writes: 4.2 MB instead of 8.4 MB; FIDs against it move
by about +0.002, measured at FID 0.5 and 12.9).

`in-domain` uses the zoo classifier's penultimate features (`MNISTClassifierFeatures`, 128-d); `inception` the
standard FID Inception-v3 pool3 (2048-d, `FIDInceptionV3`, tf1-bilinear resize to 299x299). The Inception pass over
10,000 images takes about half an hour on 2 CPU cores, so features are computed in chunks kept in `--work-dir`: a
killed run resumes from the last finished chunk. Every chunk carries its fingerprint (the feature net's protocol and
weights hash, its image range, a hash of its input images) and a checksum: a chunk of another feature net, other
images or a truncated / edited one is recomputed with a warning naming the file. The natural-image and
texture zoos' statistics (`--dataset natural|textures --features inception`: 364 / 1,800 held-out crops) are not
shipped (the asset budget); `mmspec bench ar-image --dataset natural|textures` makes them once under
`runs/reference-stats/`. `--dtype float32` (the default) halves the file size (`float16` quarters it); readers
convert to float64 (ADM's evaluator does the same), and the FID it gives differs from a float64 file by < 1e-4.
"""

import argparse
import logging
import sys
from pathlib import Path


logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
FEATURES = ("in-domain", "inception")
FILE_NAMES = {"in-domain": "{dataset}-{split}-classifier.npz", "inception": "{dataset}-{split}-inception.npz"}


def shipped_stats_path(features: str, split: str = "test", folder: str | Path | None = None,
                       dataset: str = "mnist") -> Path:  # fmt: skip
    """Where `mmspec eval reference` writes (and the shipped assets keep) the statistics of `features`."""
    if features not in FEATURES:
        raise ValueError(f"features must be one of {FEATURES}, got {features!r}")
    folder = Path(folder) if folder is not None else ROOT / "assets" / "reference-stats"
    return folder / FILE_NAMES[features].format(dataset=dataset, split=split)


def build_extractor(features: str, zoo: str | Path):
    if features == "in-domain":
        from mmspec.eval.metrics import MNISTClassifierFeatures
        from mmspec.models import load

        return MNISTClassifierFeatures(load(Path(zoo) / "mnist-classifier"))
    from mmspec.eval.inception import FIDInceptionV3

    return FIDInceptionV3()


def make_reference(features: str, split: str, out: Path, zoo: Path, work_dir: Path, dtype: str = "float32",
                   progress: bool = True, packed: bool = False, dataset: str = "mnist") -> Path:  # fmt: skip
    """Compute and save the statistics of `dataset`'s `split` for `features`; returns the file."""
    from mmspec.data.datasets import data_note, load_images
    from mmspec.eval.reference_stats import ReferenceStats, chunked_features, feature_statistics, save_reference_stats

    images, _ = load_images(dataset, split)  # [N, 1, H, W] in [-1, 1]
    extractor = build_extractor(features, zoo)
    prefix = "" if dataset == "mnist" else f"{dataset}-"  # MNIST's chunk folders keep their names
    feats = chunked_features((images + 1) / 2, extractor, work_dir / f"{prefix}{features}-{split}",
                             batch_size=500 if features == "in-domain" else 50, progress=progress)  # fmt: skip
    mu, sigma = feature_statistics(feats)
    protocol = extractor.protocol() | {"reference": f"{data_note(dataset, split)}, {len(feats)} images"}
    stats = ReferenceStats(mu, sigma, num_samples=len(feats), protocol=protocol)
    path = shipped_stats_path(features, split, out, dataset)
    return save_reference_stats(path, stats, dtype=dtype, packed=packed)


def main(argv=None):
    from mmspec.cli.args import DEFAULT_ZOO, names_of
    from mmspec.cli.checks import (
        check_dataset,
        check_mnist,
        check_output_file,
        check_output_folder,
        check_zoo_folders,
    )
    from mmspec.eval import cli_checks as checks
    from mmspec.eval.reference_stats import STORED_DTYPES

    parser = argparse.ArgumentParser(prog="mmspec eval reference", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    from mmspec.data.datasets import DATASETS

    parser.add_argument("--dataset", default="mnist", choices=DATASETS, help="real images (mmspec.data.datasets)")
    parser.add_argument("--split", default="test", choices=("train", "val", "test"), help="the dataset's split")
    parser.add_argument("--features", type=names_of(FEATURES), default="in-domain,inception",
                        help=f"comma-separated subset of {FEATURES}")  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "assets" / "reference-stats", help="output folder")
    parser.add_argument("--zoo", type=Path, default=Path(DEFAULT_ZOO), help="zoo folder (for mnist-classifier)")
    parser.add_argument("--work-dir", type=Path, default=Path("runs") / "reference", help="resumable feature chunks")
    parser.add_argument("--dtype", default="float32", choices=STORED_DTYPES, help="stored precision")
    parser.add_argument("--packed", action="store_true",
                        help="store the covariance as its upper triangle (exact, half the size; mmspec reads it, "
                             "ADM's tools do not)")  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    names = args.features
    if "in-domain" in names:
        if args.dataset != "mnist":
            parser.error("argument --features: in-domain features are the MNIST classifier's: use --features "
                         f"inception with --dataset {args.dataset}")  # fmt: skip
        check_zoo_folders(parser, args.zoo, ["mnist-classifier"])
    if "inception" in names:
        checks.check_inception(parser, "--features")
    if args.dataset == "mnist":
        check_mnist(parser, "--split", f"MNIST {args.split}")
    else:
        check_dataset(parser, "--dataset", args.dataset, f"{args.dataset} {args.split}")
    check_output_folder(parser, "--out", args.out)
    for name in names:
        check_output_file(
            parser,
            "--out",
            shipped_stats_path(name, args.split, args.out, args.dataset),
            (".npz",),
            create_folder=True,
        )
    check_output_folder(parser, "--work-dir", args.work_dir)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO)
    for name in names:
        path = make_reference(
            name, args.split, args.out, args.zoo, args.work_dir, args.dtype, not args.quiet, args.packed, args.dataset
        )
        logger.info("wrote %s (%.1f MB)", path, path.stat().st_size / 1e6)
    return 0


if __name__ == "__main__":
    sys.exit(main())
