"""Benchmarks: ``mmspec bench SUBCOMMAND [options]`` (or ``python -m mmspec.eval.bench``).

Subcommands are one line each in ``SUBCOMMANDS``: ``name -> ("module[:attribute]", help)``, naming an object (a
module, or an attribute of one) with ``add_arguments(parser)`` and ``run(args) -> dict``; only the chosen one is
imported. The module may also define ``check_args(parser, args)``: the checks that need more than one flag or a cheap
look at the disk (zoo folders, device, output paths), run before ``run`` so a bad command line is a usage error
(exit 2) before any model loads; and ``finish(args, report)``: optional extras (plots) made after the report is
written. The dict is written to ``--json PATH`` if given (checked up front; written atomically, before the extras,
so a finished report is never lost). Timings use `time.perf_counter` around each call, after
warm-up calls, with a device synchronise on accelerators, and report the median (plus p10/p90) over repeats. Every
report records the host's CPU model (``"cpu"``): small-batch matrix products, hence speculative speedups on a CPU,
differ between CPU models.

``verify`` (`mmspec.eval.bench_verify`): cost per call of every `mmspec.verify` rule at batch 1 and 16, K=8 draft
tokens, V=16384 (LlamaGen's codebook), float32 on CPU by default. This module imports no torch (`--help` is fast).
"""

import argparse
import importlib
import logging
import platform
import sys
from pathlib import Path

from mmspec.cli.args import HelpFormatter
from mmspec.cli.checks import check_output_file, write_json


logger = logging.getLogger(__name__)

__all__ = ["SUBCOMMANDS", "main"]

# name -> ("module[:attribute]" with add_arguments(parser) and run(args) -> dict, help); one line each
SUBCOMMANDS = {
    "ar-image": ("mmspec.eval.bench_ar_image", "AR-image methods side by side on the MNIST zoo (speed + accuracy)"),
    "verify": ("mmspec.eval.bench_verify", "per-call cost of the verification rules (mmspec.verify)"),
    "continuous": ("mmspec.eval.bench_continuous", "MAR + CSpD side by side on the MNIST zoo (speed, accuracy, FID)"),
    "vlm": ("mmspec.eval.bench_vlm", "VLM: plain, transformers (assisted), draft LM, EAGLE side by side (speed)"),
    "t2i": ("mmspec.eval.bench_t2i", "Janus / Janus-Pro text-to-image: training-free methods side by side (speed)"),
    "gpu": ("mmspec.eval.bench_gpu", "GPU bench kit: zoo rows eager/compiled, real-size per-round costs, projections"),
    "profile": ("mmspec.eval.bench_profile", "CPU proxy of launch cost: host reads and ops per round, by phase"),
}


def _subcommand(spec: str):
    module, _, attr = spec.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj


def cpu_model() -> str:
    """The host CPU's model name (`/proc/cpuinfo` on Linux, else `platform.processor()`; "unknown" if neither)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ----------------------------------------------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="mmspec bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    bench = chosen = None
    for name, (spec, help_text) in SUBCOMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        if argv and argv[0] == name:  # only the chosen subcommand's module is imported
            bench, chosen = _subcommand(spec), cmd
            cmd.add_argument("--json", type=Path, default=None,
                             help="write the report here (.json, in an existing folder)")  # fmt: skip
            bench.add_arguments(cmd)
    args = parser.parse_args(argv)
    if args.json is not None:
        check_output_file(chosen, "--json", args.json, (".json",))
    if hasattr(bench, "check_args"):
        bench.check_args(chosen, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    report = bench.run(args)
    report.setdefault("cpu", cpu_model())
    if args.json is not None:
        write_json(args.json, report)
        logger.info("wrote %s", args.json)
    if hasattr(bench, "finish"):
        bench.finish(args, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
