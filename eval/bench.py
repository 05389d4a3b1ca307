"""Benchmarks: ``mmspec bench SUBCOMMAND [options]`` (or ``python -m mmspec.eval.bench``).

Subcommands are one line each in ``SUBCOMMANDS``: ``name -> ("module[:attribute]", help)``, naming an object (a
module, or an attribute of one) with ``add_arguments(parser)`` and ``run(args) -> dict``; only the chosen one is
imported. The dict is written to ``--json PATH`` if given. Timings use `time.perf_counter` around each call, after
warm-up calls, with a device synchronise on accelerators, and report the median (plus p10/p90) over repeats.

``verify`` (`mmspec.eval.bench_verify`): cost per call of every `mmspec.verify` rule at batch 1 and 16, K=8 draft
tokens, V=16384 (LlamaGen's codebook), float32 on CPU by default. This module imports no torch (`--help` is fast).
"""

import argparse
import importlib
import json
import logging
import sys
from pathlib import Path


logger = logging.getLogger(__name__)

__all__ = ["SUBCOMMANDS", "main"]

# name -> ("module[:attribute]" with add_arguments(parser) and run(args) -> dict, help); one line each
SUBCOMMANDS = {
    "ar-image": ("mmspec.eval.bench_ar_image", "AR-image methods side by side on the MNIST zoo (speed + accuracy)"),
    "verify": ("mmspec.eval.bench_verify", "per-call cost of the verification rules (mmspec.verify)"),
    "continuous": ("mmspec.eval.bench_continuous", "MAR + CSpD side by side on the MNIST zoo (speed, accuracy, FID)"),
    "vlm": ("mmspec.eval.bench_vlm", "VLM: plain, transformers (assisted), draft LM, EAGLE side by side (speed)"),
}


def _subcommand(spec: str):
    module, _, attr = spec.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj


# ----------------------------------------------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="mmspec bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    for name, (spec, help_text) in SUBCOMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        if argv and argv[0] == name:  # only the chosen subcommand's module is imported
            bench = _subcommand(spec)
            cmd.add_argument("--json", type=Path, default=None, help="write the report here")
            bench.add_arguments(cmd)
            cmd.set_defaults(_run=bench.run)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    report = args._run(args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        logger.info("wrote %s", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
