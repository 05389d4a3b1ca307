"""Evaluation: benchmarks (`mmspec bench`), metrics (`metrics.py`, `inception.py`, `reference_stats.py`) and the
`mmspec eval` scripts, registered one line each in `COMMANDS`."""

# `mmspec eval NAME` -> ("module:function" called with the remaining arguments, help)
COMMANDS = {
    "fid": (
        "mmspec.eval.fid:main",
        "sample N images into resumable shards (1 or many ranks) and score FID / accuracy",
    ),
}


def main(argv=None):
    """`mmspec eval NAME ...`: dispatch to the registered script."""
    import sys

    from mmspec.cli import dispatch

    argv = list(sys.argv[1:] if argv is None else argv)
    return dispatch(COMMANDS, argv, "mmspec eval", __doc__.split("\n")[0])
