"""`mmspec generate`: sample a grid of digits from the shipped MNIST zoo with speculative decoding and print the
speed statistics next to plain AR decoding of the same images.

The method options come from the registry `mmspec.methods`: `--acceptance` / `--drafter` choices from
`ACCEPTANCES` / `DRAFTERS`, one flag per pipeline knob of `KNOBS` (`mmspec.cli.args.add_knob_arguments`), so an
unknown method or an out-of-range knob is a usage error (exit 2) before anything is loaded. Every other option is
checked up front too (`check_args`: class ids against the zoo's `config.json`, the output path, the device, knob
flags the chosen method never reads) so a bad command line never costs a model load.
"""

import argparse
import json
import logging
import sys
import time

from mmspec.cli.args import (
    DEFAULT_ZOO,
    MAX_BATCH,
    SPEEDUP_REPEATS,
    HelpFormatter,
    add_knob_arguments,
    int_in_range,
    knob_values,
    sampling_type,
    seed_int,
    threads_int,
)
from mmspec.cli.checks import (
    check_device,
    check_knobs_used,
    check_output_file,
    check_sampling_only,
    check_top_k_vocab,
)


logger = logging.getLogger(__name__)

__all__ = ["ZooError", "add_arguments", "check_args", "main", "run"]

NUM_PER_CLASS = 2  # default images per class id
MAX_IMAGES = 10_000  # images in one grid (each costs a full decode and grid memory)


def _class_ids(text):
    """argparse `type` of `--classes`: comma-separated integers >= 0, at least one (the zoo's range is checked
    after parsing)."""
    ids = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            ids.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"class id {part.strip()!r} is not an integer (e.g. 0,1,2)") from None
        if ids[-1] < 0:
            raise argparse.ArgumentTypeError(f"class ids must be >= 0, got {ids[-1]}")
    if not ids:
        raise argparse.ArgumentTypeError(f"expected comma-separated class ids like 0,1,2, got {text!r}")
    return ids


def add_arguments(parser):
    from mmspec.methods import DRAFTERS, acceptance_names

    parser.add_argument("--zoo", default=DEFAULT_ZOO, help="folder holding the zoo (mnist-c2i, mnist-vq, drafters)")
    parser.add_argument("--classes", type=_class_ids, default="0,1,2,3,4,5,6,7,8,9", metavar="IDS",
                        help="comma-separated class ids, each in [0, the zoo's num_classes)")  # fmt: skip
    parser.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                        help="text-to-image: a prompt for the zoo's t2i model (<zoo>/mnist-t2i); repeat the flag for "
                             "several prompts (one grid row each); replaces --classes")  # fmt: skip
    count = parser.add_mutually_exclusive_group()
    count.add_argument("--num-per-class", type=int_in_range(1, MAX_IMAGES), default=None, metavar="N",  # None: see --num-images
                       help=f"images per class id; the grid has one row per class id (default: {NUM_PER_CLASS})")  # fmt: skip
    count.add_argument("--num-images", type=int_in_range(1, MAX_IMAGES), default=None, metavar="N",
                       help="instead of --num-per-class: N images in all, image i of class id i mod (number of "
                            "--classes ids), so the grid has one column per class id")  # fmt: skip
    parser.add_argument("--batch-size", type=int_in_range(1, MAX_BATCH), default=1, metavar="N",
                        help="images per pipeline call (1 = the latency regime speculative decoding targets)")  # fmt: skip
    parser.add_argument("--acceptance", default="jacobi", choices=list(acceptance_names("image")),
                        help="acceptance rule (jacobi: SJD + SCD coupling, lossless)")  # fmt: skip
    parser.add_argument("--drafter", default=None, choices=list(DRAFTERS),
                        help="drafter (default: the acceptance's first drafter the zoo has)")  # fmt: skip
    parser.add_argument("--guidance-scale", type=sampling_type("guidance_scale", float), default=2.0, metavar="S",
                        help="classifier-free guidance scale (>= 0; 1 = no guidance)")  # fmt: skip
    parser.add_argument("--temperature", type=sampling_type("temperature", float), default=1.0, metavar="T",
                        help="sampling temperature (>= 0; 0 = greedy, not allowed for sampling-only rules)")  # fmt: skip
    parser.add_argument("--top-k", type=sampling_type("top_k", int), default=None, metavar="K",
                        help="keep the K most likely tokens (>= 1; unset: off)")  # fmt: skip
    parser.add_argument("--seed", type=seed_int, default=0, help="the call starting at image i uses seed + i")
    parser.add_argument("--device", default="cpu", help="device the models run on (and the generators live on)")
    parser.add_argument("--threads", type=threads_int, default=None, metavar="N",
                        help="torch CPU threads (torch.set_num_threads; unset: torch's default)")  # fmt: skip
    parser.add_argument("--out", default="mmspec_samples.png", help="image grid to write (PNG; folder must exist)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the plain-AR comparison run")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_knob_arguments(parser)


def _check_out(parser, out):
    """`--out` of `generate`: an image file PIL can write, in an existing writable folder."""
    check_output_file(parser, "--out", out, "image")


def check_args(parser, args):
    """The checks that need more than one flag or a cheap look at the disk; all before any model loads.

    Reads the zoo's `config.json` files (`mmspec.models.read_config`: no weights, no torch) for the number of
    classes, resolves the (acceptance, drafter) pair against the drafter folders the zoo has, and checks `--out`.
    Sets `args.labels` (the class id of every image) and `args.grid_columns`.
    """
    from mmspec.methods import resolve_drafter
    from mmspec.models import read_config, zoo_folders

    args.kind = "c2i" if args.prompt is None else "t2i"
    if args.prompt is not None and not all(p.strip() for p in args.prompt):
        parser.error("argument --prompt: a prompt is empty")
    try:
        folders = zoo_folders(args.zoo, kind=args.kind)
        configs = {name: read_config(folder) for name, folder in folders.items()}
    except ValueError as err:
        parser.error(f"argument {'--zoo' if args.prompt is None else '--prompt'}: {err}")
    if args.prompt is not None:
        args.classes = list(args.prompt)  # the grid's rows: one per prompt
    num_classes = configs["transformer"].get("num_classes", 1000)  # the class default, as the loader would use
    bad = [c for c in args.classes if isinstance(c, int) and c >= num_classes]
    if bad:
        parser.error(
            f"argument --classes: class id {bad[0]} is out of range: the zoo's target has {num_classes} classes "
            f"(ids 0..{num_classes - 1})"
        )
    try:
        drafter = resolve_drafter(args.acceptance, args.drafter, set(folders))
    except ValueError as err:
        parser.error(f"argument --drafter: {err} (zoo: {args.zoo})")
    check_knobs_used(parser, knob_values(args), args.acceptance, drafter)
    check_sampling_only(parser, args.acceptance, args.temperature)
    check_top_k_vocab(parser, args.top_k, configs["transformer"].get("vocab_size"), f"the zoo's target ({args.zoo})")
    _check_out(parser, args.out)
    check_device(parser, args.device)
    if args.num_images is not None:
        args.labels = [args.classes[i % len(args.classes)] for i in range(args.num_images)]
        args.grid_columns = min(len(args.classes), args.num_images)
    else:
        per_class = NUM_PER_CLASS if args.num_per_class is None else args.num_per_class
        args.labels = [c for c in args.classes for _ in range(per_class)]
        args.grid_columns = per_class


class ZooError(ValueError):
    """The zoo's models failed to load or do not fit together (a usage error of `--zoo`, found while loading)."""


def _call_batch(pipe, args, kw, i):
    """One pipeline call: the batch of `args.labels` starting at image `i`, seed `args.seed + i` (synchronised on
    an accelerator, so that wall-clock time is the call's)."""
    import torch

    device = pipe._execution_device
    common = dict(guidance_scale=args.guidance_scale, temperature=args.temperature, top_k=args.top_k)
    gen = torch.Generator(device=device).manual_seed(args.seed + i)
    condition = args.labels[i : i + args.batch_size]
    condition = dict(class_labels=condition) if args.prompt is None else dict(prompt=condition)
    out = pipe(generator=gen, **condition, **common, **kw)
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)
    return out


def _run_method(pipe, args, kw, bar):
    """Generate every image of `args.labels` with the method keywords `kw`; returns (images, stats dict)."""
    labels = args.labels
    images, forwards, compression, accepted, wall = [], 0, [], [], 0.0
    for i in range(0, len(labels), args.batch_size):
        start = time.perf_counter()
        out = _call_batch(pipe, args, kw, i)
        wall += time.perf_counter() - start
        images += out.images
        forwards += out.stats.target_forwards
        compression.append(out.stats.step_compression)
        accepted.append(out.stats.mean_accepted_length)
        bar.update(len(out.images))
    stats = dict(wall_s=wall, s_per_image=round(wall / len(labels), 4), target_forwards=forwards,
                 step_compression=round(sum(compression) / len(compression), 3),
                 mean_accepted_length=round(sum(accepted) / len(accepted), 3))  # fmt: skip
    return images, stats


def run(args):
    """Run `mmspec generate` on parsed, checked arguments (`check_args`); prints and returns the report.

    Report keys: the requested method's run under `"speculative"` (`"plain"` when `--acceptance none`), plain AR
    decoding of the same images and seeds under `"plain_baseline"` (their `wall_s` include the first, cold calls),
    and `"speedup_vs_plain"`: plain / speculative median wall time of the first batch over `SPEEDUP_REPEATS`
    interleaved calls each, after the grid runs warmed both up (`mmspec.timing.fair_speedup`; `"speedup_timing"`
    says so, and the same line goes to stderr). Both absent with `--no-baseline`.
    """
    import torch
    from tqdm.auto import tqdm

    from mmspec.eval.images import make_grid
    from mmspec.methods import resolve_drafter
    from mmspec.pipelines import SpeculativeARImagePipeline

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        pipe = SpeculativeARImagePipeline.from_zoo(args.zoo, kind=args.kind)
    except ValueError as err:  # e.g. weights that do not match their config.json: the message names the folder
        raise ZooError(str(err)) from err
    pipe = pipe.to(args.device)
    pipe.set_progress_bar_config(disable=True)  # one bar over all images instead (below)
    loaded = {name for name in ("draft_model", "eagle_head") if getattr(pipe, name, None) is not None}
    drafter = resolve_drafter(args.acceptance, args.drafter, loaded)
    knobs = knob_values(args)
    first = "plain" if args.acceptance == "none" else "speculative"
    runs = [(first, dict(acceptance=args.acceptance, drafter=args.drafter, **knobs))]
    if not args.no_baseline and args.acceptance != "none":
        runs.append(("plain_baseline", dict(acceptance="none")))
    labels = args.labels
    condition = {"classes": args.classes} if args.prompt is None else {"prompts": args.prompt}
    report = {"out": args.out, "images": len(labels), **condition, "batch_size": args.batch_size,
              "seed": args.seed, "device": args.device, "threads": torch.get_num_threads(),
              "sampling": dict(guidance_scale=args.guidance_scale, temperature=args.temperature, top_k=args.top_k)}  # fmt: skip
    bar = tqdm(total=len(labels) * len(runs), unit="image", disable=args.quiet)
    for name, kw in runs:
        bar.set_description(name.replace("_", " "))
        images, stats = _run_method(pipe, args, kw, bar)
        method = {"acceptance": kw["acceptance"]}
        if name != "plain_baseline":
            method.update(drafter=drafter, knobs=knobs)
            make_grid(images, args.grid_columns).save(args.out)
        report[name] = method | stats
    bar.close()
    line = None
    if "plain_baseline" in report:
        # the grid runs above warmed both methods up (the first was also cold): the speedup is timed apart, the two
        # methods interleaved on the first batch, median over repeats (mmspec.timing)
        from mmspec.timing import fair_speedup, speedup_line

        timing = fair_speedup(lambda: _call_batch(pipe, args, runs[1][1], 0),
                              lambda: _call_batch(pipe, args, runs[0][1], 0), repeats=SPEEDUP_REPEATS, warmup=0)  # fmt: skip
        batch = min(args.batch_size, len(labels))
        what = f"the first batch ({batch} image{'s' * (batch > 1)})"
        line = speedup_line(timing, what, torch.get_num_threads(), warmed_by="the full grid runs warmed both up")
        report["speedup_vs_plain"] = None if timing["speedup"] is None else round(timing["speedup"], 3)
        report["speedup_timing"] = dict(what=what, repeats=timing["repeats"],
                                        plain_median_s=round(timing["a_median_s"], 4),
                                        speculative_median_s=round(timing["b_median_s"], 4), note=line)  # fmt: skip
    for name, _ in runs:
        report[name]["wall_s"] = round(report[name]["wall_s"], 3)
    print(json.dumps(report, indent=2))
    if line is not None:
        print(line, file=sys.stderr)
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="mmspec generate", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    add_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    check_args(parser, args)
    logging.basicConfig(level=logging.WARNING)
    try:
        run(args)
    except ZooError as err:
        parser.error(f"argument --zoo: {err}")
    return 0
