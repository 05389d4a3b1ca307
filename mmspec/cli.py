"""Command line: `mmspec COMMAND [options]`, commands registered in `COMMANDS` (one line each).

`mmspec generate` (the README's main job) samples a grid of digits from the shipped MNIST zoo with speculative
decoding and prints the speed statistics next to plain AR decoding of the same images. `mmspec bench` and
`mmspec train` hand their arguments to their own entry points (`mmspec bench --help`, `mmspec train --help`).

The method options come from the registry `mmspec.methods`: `--acceptance` / `--drafter` choices from
`ACCEPTANCES` / `DRAFTERS`, one flag per pipeline knob of `KNOBS` (`add_knob_arguments`, shared with the
benchmarks), so an unknown method or an out-of-range knob is a usage error (exit 2) before anything is loaded.
"""

import argparse
import importlib
import json
import logging
import sys
import time
from pathlib import Path

from mmspec.methods import ACCEPTANCES, DRAFTERS, KNOBS, check_knob


logger = logging.getLogger(__name__)

__all__ = ["COMMANDS", "add_knob_arguments", "knob_values", "main"]

# command -> ("module:function" called with the remaining arguments, help); `eval`, `demo` go here, one line each
COMMANDS = {
    "generate": ("mmspec.cli:generate_main", "sample a digit grid from the MNIST zoo and print speed stats"),
    "bench": ("mmspec.eval.bench:main", "benchmarks (see `mmspec bench --help`)"),
    "train": ("mmspec.train.__main__:main", "train zoo models (see `mmspec train --help`)"),
    "eval": ("mmspec.eval:main", "evaluation scripts: fid (see `mmspec eval --help`)"),
}


def _entry_point(spec):
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


# ----------------------------------------------------------------------------------------------------------------
# knob flags from the registry


def _knob_type(name):
    """argparse `type` for knob `name`: parse as its kind, then `check_knob` (a failure is a usage error)."""
    knob = KNOBS[name]

    def parse(text):
        try:
            return check_knob(name, knob.kind(text))
        except (TypeError, ValueError) as err:
            raise argparse.ArgumentTypeError(str(err)) from err

    return parse


def add_knob_arguments(parser, names=None):
    """One flag per pipeline knob of `mmspec.methods.KNOBS` (`--name-with-dashes`; bools as `--x / --no-x`).

    Every flag defaults to None (= unset: the pipeline's default applies); `knob_values(args)` collects the set ones.
    """
    group = parser.add_argument_group("method knobs (unset: the pipeline's default)")
    for name in KNOBS if names is None else names:
        knob = KNOBS[name]
        flag = "--" + name.replace("_", "-")
        notes = ([] if knob.default is None else [f"default: {knob.default}"]) + (
            [f"read by {', '.join(knob.used_by)}"] if knob.used_by else []
        )
        help_text = (knob.help + (f" ({'; '.join(notes)})" if notes else "")).replace("%", "%%")
        if knob.kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif isinstance(knob.kind, tuple):
            group.add_argument(flag, choices=knob.kind, default=None, help=help_text)
        else:
            group.add_argument(flag, type=_knob_type(name), default=None, metavar=knob.kind.__name__.upper(),
                               help=help_text)  # fmt: skip


def knob_values(args):
    """The knob flags of `add_knob_arguments` that were set, as pipeline keywords."""
    return {name: getattr(args, name) for name in KNOBS if getattr(args, name, None) is not None}


# ----------------------------------------------------------------------------------------------------------------
# generate


def _generate_args(parser):
    parser.add_argument("--zoo", default=str(Path(__file__).resolve().parent.parent / "assets"),
                        help="folder holding the zoo (mnist-c2i, mnist-vq, drafters); default: the shipped assets")  # fmt: skip
    parser.add_argument("--classes", default="0,1,2,3,4,5,6,7,8,9", help="comma-separated class ids")
    parser.add_argument("--num-per-class", type=int, default=2)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="images per pipeline call (1 = the latency regime speculative decoding targets)",
    )
    parser.add_argument("--acceptance", default="jacobi", choices=list(ACCEPTANCES),
                        help="acceptance rule (default: jacobi, SJD + SCD coupling, lossless)")  # fmt: skip
    parser.add_argument("--drafter", default=None, choices=list(DRAFTERS), help="drafter (default: per acceptance)")
    parser.add_argument("--guidance-scale", type=float, default=2.0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="device the models run on (and the generators live on)")
    parser.add_argument("--out", default="mmspec_samples.png", help="PNG grid to write (one row per class)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the plain-AR comparison run")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_knob_arguments(parser)


def generate(args):
    import torch
    from tqdm.auto import tqdm

    from mmspec.eval.images import make_grid
    from mmspec.pipelines import SpeculativeARImagePipeline

    pipe = SpeculativeARImagePipeline.from_zoo(args.zoo).to(args.device)
    pipe.set_progress_bar_config(disable=True)  # one bar over all images instead (below)
    device = pipe._execution_device
    classes = [int(c) for c in args.classes.split(",") if c.strip()]
    common = dict(guidance_scale=args.guidance_scale, temperature=args.temperature, top_k=args.top_k)
    labels = [c for c in classes for _ in range(args.num_per_class)]
    runs = {}
    methods = [("speculative", dict(acceptance=args.acceptance, drafter=args.drafter, **knob_values(args)))]
    if not args.no_baseline and args.acceptance != "none":
        methods.append(("plain", dict(acceptance="none")))
    bar = tqdm(total=len(labels) * len(methods), unit="image", disable=args.quiet)
    for name, kw in methods:
        images, forwards, compression, accepted, wall = [], 0, [], [], 0.0
        bar.set_description(name)
        for i in range(0, len(labels), args.batch_size):
            gen = torch.Generator(device=device).manual_seed(args.seed + i)
            start = time.perf_counter()
            out = pipe(class_labels=labels[i : i + args.batch_size], generator=gen, **common, **kw)
            wall += time.perf_counter() - start
            images += out.images
            forwards += out.stats.target_forwards
            compression.append(out.stats.step_compression)
            accepted.append(out.stats.mean_accepted_length)
            bar.update(len(out.images))
        runs[name] = dict(images=images, wall_s=round(wall, 3), target_forwards=forwards,
                          step_compression=round(sum(compression) / len(compression), 3),
                          mean_accepted_length=round(sum(accepted) / len(accepted), 3))  # fmt: skip
    bar.close()
    make_grid(runs["speculative"].pop("images"), args.num_per_class).save(args.out)
    runs.get("plain", {}).pop("images", None)
    report = {"out": args.out, "images": len(labels), "batch_size": args.batch_size, "acceptance": args.acceptance}
    report.update(runs)
    if "plain" in runs:
        report["speedup"] = round(runs["plain"]["wall_s"] / runs["speculative"]["wall_s"], 3)
    print(json.dumps(report, indent=2))
    return report


def generate_main(argv=None):
    parser = argparse.ArgumentParser(prog="mmspec generate", description=COMMANDS["generate"][1])
    _generate_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    generate(args)
    return 0


# ----------------------------------------------------------------------------------------------------------------


def dispatch(commands, argv, prog, description):
    """Run `commands[argv[0]]` (a `"module:function"` taking the remaining arguments), or let argparse print the
    usage / the unknown-command error (exit 2) listing the table."""
    if argv and argv[0] in commands:
        return _entry_point(commands[argv[0]][0])(argv[1:]) or 0
    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in commands.items():
        sub.add_parser(name, help=help_text, add_help=False)
    parser.parse_args(argv)
    return 0


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    return dispatch(COMMANDS, argv, "mmspec", __doc__.split("\n\n")[0])


if __name__ == "__main__":
    sys.exit(main())
