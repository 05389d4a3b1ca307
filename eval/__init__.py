"""Evaluation: benchmarks (`mmspec bench`), metrics (`metrics.py`, `inception.py`, `reference_stats.py`) and the
`mmspec eval` scripts, registered one line each in `COMMANDS`."""

import importlib


# `mmspec eval NAME` -> ("module:function" called with the remaining arguments, help)
COMMANDS = {
    "fid": (
        "mmspec.eval.fid:main",
        "sample N images into resumable shards (1 or many ranks) and score FID / accuracy",
    ),
}


def main(argv=None):
    """`mmspec eval NAME ...`: dispatch to the registered script."""
    import argparse
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        module, function = COMMANDS[argv[0]][0].split(":")
        return getattr(importlib.import_module(module), function)(argv[1:]) or 0
    parser = argparse.ArgumentParser(prog="mmspec eval", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="NAME")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    parser.parse_args(argv)
    return 0
