"""Evaluation scripts (`mmspec eval NAME`): FID sampling and scoring, the quality-vs-speed sweep, reference stats.

The package also holds the benchmarks (`mmspec bench`) and the metrics: `metrics.py` (FID, in-domain), `kid.py`,
`inception_score.py`, `clip_score.py`, `inception.py` (the FID Inception-v3), `reference_stats.py` (.npz);
`fingerprint.py` (the weights-and-settings fingerprints that keep stale shards, rows and chunks from being reused)
and `cli_checks.py` (the usage checks only the three scripts need). The scripts are registered one line each in
`COMMANDS`."""

# `mmspec eval NAME` -> ("module:function" called with the remaining arguments, help)
COMMANDS = {
    "fid": (
        "mmspec.eval.fid:main",
        "sample N images into resumable shards (1 or many ranks) and score FID / accuracy",
    ),
    "sweep": ("mmspec.eval.sweep:main", "methods x knobs on one model: quality vs speed table and Pareto plot"),
    "reference": ("mmspec.eval.reference:main", "reference statistics (.npz) of real MNIST for FID"),
}


def main(argv=None):
    """`mmspec eval NAME ...`: dispatch to the registered script."""
    import sys

    from mmspec.cli.args import dispatch

    argv = list(sys.argv[1:] if argv is None else argv)
    return dispatch(COMMANDS, argv, "mmspec eval", __doc__.split("\n")[0])
