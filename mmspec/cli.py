"""Command line: `mmspec COMMAND [options]`, commands registered in `COMMANDS` (one line each).

`mmspec generate` (the README's main job) samples a grid of digits from the shipped MNIST zoo with speculative
decoding and prints the speed statistics next to plain AR decoding of the same images. `mmspec bench` and
`mmspec train` hand their arguments to their own entry points (`mmspec bench --help`, `mmspec train --help`).

The method options come from the registry `mmspec.methods`: `--acceptance` / `--drafter` choices from
`ACCEPTANCES` / `DRAFTERS`, one flag per pipeline knob of `KNOBS` (`add_knob_arguments`, shared with the
benchmarks), so an unknown method or an out-of-range knob is a usage error (exit 2) before anything is loaded.
Every other `generate` option is checked up front too (class ids against the zoo's `config.json`, the output path,
the device, knob flags the chosen method never reads) so a bad command line never costs a model load. Shared with
every command: `seed_int` / `threads_int` (bounded by `MAX_SEED` / `MAX_THREADS`), `int_in_range` for counts that cost
memory or time, `check_output_file`, `check_device`, `check_zoo_folders` and `write_json` (atomic: temp file +
rename, so a finished report is never left truncated). This module imports nothing heavy at import time
(`mmspec --help` does not import torch); the registry is imported when a parser needs it.
"""

import argparse
import importlib
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

from mmspec.data.zoo import DEFAULT_ZOO as _DEFAULT_ZOO


logger = logging.getLogger(__name__)

__all__ = [
    "COMMANDS",
    "HelpFormatter",
    "DEFAULT_ZOO",
    "MAX_SEED",
    "MAX_THREADS",
    "add_knob_arguments",
    "check_device",
    "check_knob_combination",
    "check_output_file",
    "check_output_folder",
    "check_zoo_folders",
    "finite_float",
    "int_in_range",
    "int_list_in_range",
    "knob_values",
    "main",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "probability",
    "sampling_type",
    "seed_int",
    "threads_int",
    "write_json",
]

# command -> ("module:function" called with the remaining arguments, help); `eval`, `demo` go here, one line each
COMMANDS = {
    "generate": ("mmspec.cli:generate_main", "sample a digit grid from the MNIST zoo and print speed stats"),
    "vlm": ("mmspec.cli_vlm:main", "ask the VLM zoo about an image (speculative decoding) and print speed stats"),
    "bench": ("mmspec.eval.bench:main", "benchmarks (see `mmspec bench --help`)"),
    "train": ("mmspec.train.__main__:main", "train zoo models (see `mmspec train --help`)"),
    "eval": ("mmspec.eval:main", "evaluation scripts: fid (see `mmspec eval --help`)"),
    "demo": (
        "mmspec.demo.__main__:main",
        "serve the Gradio demo: plain vs speculative decoding side by side, one tab per pipeline",
    ),
}
NUM_PER_CLASS = 2  # `mmspec generate` default
DEFAULT_ZOO = str(_DEFAULT_ZOO)  # `mmspec.data.zoo` (no torch import), as a flag default
# `torch.Generator.manual_seed` takes seeds below 2**64; commands add image / repeat offsets to `--seed`, so half of
# that range keeps every derived seed valid
MAX_SEED = 2**63 - 1
MAX_THREADS = 1024  # `--threads`: torch.set_num_threads far past any machine is a typo
MAX_IMAGES = 10_000  # `mmspec generate`: images in one grid (each costs a full decode and grid memory)
MAX_BATCH = 1024  # images per pipeline call (KV caches grow with it)
SPEEDUP_REPEATS = 3  # `generate`: interleaved timed calls of each method behind `speedup_vs_plain`


def _entry_point(spec):
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


# ----------------------------------------------------------------------------------------------------------------
# argparse types and help (shared with the benchmarks and the training tasks)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` with `(default: X)` after every option that has a default worth showing (not None / False)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def _int_at_least(text, low):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
    return value


def positive_int(text):
    """argparse `type`: an integer >= 1 (else a usage error naming the flag)."""
    return _int_at_least(text, 1)


def non_negative_int(text):
    """argparse `type`: an integer >= 0."""
    return _int_at_least(text, 0)


def positive_int_list(text):
    """argparse `type`: comma-separated integers >= 1 ("1,4"; empty items ignored, an empty list allowed)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


def int_in_range(low, high):
    """argparse `type` factory: an integer in [low, high] (an upper bound keeps a typo from costing memory or hours)."""

    def parse(text):
        value = _int_at_least(text, low)
        if value > high:
            raise argparse.ArgumentTypeError(f"must be an integer in [{low}, {high}], got {value}")
        return value

    parse.__name__ = f"int in [{low}, {high}]"
    return parse


def seed_int(text):
    """argparse `type` of `--seed`: an integer in [0, MAX_SEED] (a larger one overflows `manual_seed` after the
    models loaded)."""
    return int_in_range(0, MAX_SEED)(text)


def threads_int(text):
    """argparse `type` of `--threads`: an integer in [1, MAX_THREADS]."""
    return int_in_range(1, MAX_THREADS)(text)


def int_list_in_range(low, high):
    """argparse `type` factory: a non-empty comma list of integers in [low, high] ("1,4"; empty items ignored)."""

    def parse(text):
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"expected one or more comma-separated integers, got {text!r}")
        if min(values) < low or max(values) > high:
            raise argparse.ArgumentTypeError(f"each must be an integer in [{low}, {high}], got {text!r}")
        return values

    parse.__name__ = f"ints in [{low}, {high}]"
    return parse


def names_of(choices):
    """argparse `type` factory: a comma list of names from `choices` ("plain,eagle") -> list; unknown names (or none)
    are a usage error (exit 2) before anything loads."""

    def parse(text):
        names = [m.strip() for m in text.split(",") if m.strip()]
        unknown = sorted(set(names) - set(choices))
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown names {unknown}; known: {','.join(choices)}")
        return names

    parse.__name__ = "names"
    return parse


def weights_of(count):
    """argparse `type` factory: `count` comma-separated finite numbers >= 0, not all 0 ("1,2,3,4") -> tuple."""

    def parse(text):
        values = tuple(non_negative_float(v) for v in text.split(","))
        if len(values) != count or not any(values):
            raise argparse.ArgumentTypeError(f"expected {count} comma-separated weights, not all 0, got {text!r}")
        return values

    parse.__name__ = f"{count} weights"
    return parse


def finite_float(text):
    """argparse `type`: a finite number (NaN and inf are usage errors)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_float(text):
    """argparse `type`: a finite number > 0."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def non_negative_float(text):
    """argparse `type`: a finite number >= 0."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def probability(text):
    """argparse `type`: a number in [0, 1]."""
    value = finite_float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}")
    return value


SAMPLING_LIMITS_KEYS = ("top_k",)  # the keys of mmspec.methods.SAMPLING_LIMITS (no registry import at import time)


def sampling_type(name, kind):
    """argparse `type` for a `mmspec.sampling.SamplingParams` field: parsed as `kind`, checked by SamplingParams
    itself (so the CLI accepts exactly what the pipeline does)."""

    def parse(text):
        from mmspec.sampling import SamplingParams

        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
            ) from None
        try:
            SamplingParams(**{name: value})
        except (TypeError, ValueError) as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        if name in SAMPLING_LIMITS_KEYS:
            from mmspec.methods import SAMPLING_LIMITS

            if value > SAMPLING_LIMITS[name]:
                raise argparse.ArgumentTypeError(
                    f"{name} must be at most {SAMPLING_LIMITS[name]} (and the model's vocabulary), got {value}"
                )
        return value

    parse.__name__ = name
    return parse


def limited_float(name, low, high, low_open=False):
    """argparse `type` factory: a finite number in [low, high] (`(low, high]` with `low_open`), for a knob whose
    pipeline bounds it so (e.g. `mmspec.methods.CONTINUOUS_LIMITS`); the message names the knob and the range."""

    def parse(text):
        value = finite_float(text)
        if not ((low < value) if low_open else (low <= value)) or value > high:
            raise argparse.ArgumentTypeError(
                f"{name} must be in {'(' if low_open else '['}{low:g}, {high:g}], got {text!r}"
            )
        return value

    parse.__name__ = name
    return parse


def check_top_k_vocab(parser, top_k, vocab, where, flag="--top-k"):
    """Usage error when `top_k` is more than the model's vocabulary `vocab` (read from its config.json, so before
    any model loads; `where` names the config). Nothing to check when either is unknown / unset."""
    if top_k is not None and isinstance(vocab, int) and top_k > vocab:
        parser.error(f"argument {flag}: {top_k} is more than the vocabulary of {where} ({vocab} tokens)")


def check_sampling_only(parser, acceptance, temperature, method=None, do_sample=True):
    """Usage error (naming --temperature) when a sampling-only acceptance rule (`Acceptance.sampling_only` of the
    registry: GSD) would run greedily (temperature 0 or no sampling): it is undefined there."""
    from mmspec.methods import ACCEPTANCES

    if ACCEPTANCES[acceptance].sampling_only and (temperature == 0 or not do_sample):
        what = f"the sampling method {method}" if method else f"the sampling rule --acceptance {acceptance}"
        parser.error(f"argument --temperature: 0 (greedy) does not work with {what}")


# ----------------------------------------------------------------------------------------------------------------
# knob flags from the registry


def _knob_type(name):
    """argparse `type` for knob `name`: parse as its kind, then `check_knob` (a failure is a usage error)."""
    from mmspec.methods import KNOBS, check_knob

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
    from mmspec.methods import KNOBS

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


def check_knobs_used(parser, knobs, acceptance, drafter):
    """Usage error for a knob flag that the method (`acceptance` run on `drafter`) never reads (`Knob.used_by`):
    it would be silently ignored, and the run would not be the one asked for."""
    from mmspec.methods import KNOBS

    for name in knobs:
        used_by = KNOBS[name].used_by
        if used_by and acceptance not in used_by and drafter not in used_by:
            method = f"--acceptance {acceptance}" + (f" with the {drafter} drafter" if drafter else "")
            parser.error(f"argument --{name.replace('_', '-')}: is read only by {', '.join(used_by)}, not by {method}")
    check_knob_combination(parser, knobs)


def check_knob_combination(parser, knobs):
    """Usage error for knob values that are fine alone but not together (`mmspec.methods.check_knobs`: e.g. an
    SJD-PAC tree deeper than the Jacobi window); the message names the first knob of the pair."""
    from mmspec.methods import KNOBS, check_knobs

    try:
        check_knobs(**{name: value for name, value in knobs.items() if name in KNOBS})
    except ValueError as err:
        name = str(err).split("=")[0].split(",")[0].strip()
        parser.error(f"argument --{name.replace('_', '-')}: {err}")


def knob_values(args):
    """The knob flags of `add_knob_arguments` that were set, as pipeline keywords."""
    from mmspec.methods import KNOBS

    return {name: getattr(args, name) for name in KNOBS if getattr(args, name, None) is not None}


# ----------------------------------------------------------------------------------------------------------------
# generate


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


def _generate_args(parser):
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


def check_output_file(parser, flag, out, extensions=None):
    """Usage error (exit 2, naming `flag`) unless `out` can be written: a file name (not a folder) in an existing,
    writable folder, with one of `extensions` (".json", ...; "image": any extension PIL can write). Run it before
    any model loads, so a bad path never costs a finished run."""
    path = Path(out)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        parser.error(f"argument {flag}: {str(out)!r} is a directory; give a file name inside it")
    if not parent.exists():
        parser.error(f"argument {flag}: folder {str(parent)!r} does not exist")
    if not parent.is_dir():
        parser.error(f"argument {flag}: {str(parent)!r} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        parser.error(f"argument {flag}: {str(out)!r} is not writable")
    _probe_write(parser, flag, parent, out)
    if extensions == "image":
        from PIL import Image

        Image.init()
        if Image.registered_extensions().get(path.suffix.lower()) not in Image.SAVE:
            parser.error(f"argument {flag}: {str(out)!r} needs an image extension PIL can write, e.g. .png")
    elif extensions is not None and path.suffix.lower() not in extensions:
        parser.error(f"argument {flag}: {str(out)!r} needs the extension {' or '.join(extensions)}")


def write_json(path, report):
    """Write `report` as indented JSON to `path` atomically: a temporary file in the same folder, then a rename, so
    an interrupted or failed write never leaves a truncated report (nor destroys the previous one)."""
    import tempfile

    path = Path(path)
    text = json.dumps(report, indent=2)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _check_out(parser, out):
    """`--out` of `generate`: an image file PIL can write, in an existing writable folder."""
    check_output_file(parser, "--out", out, "image")


def _probe_write(parser, flag, folder, out):
    """Usage error unless a file can really be created in `folder` (a temporary file, removed at once): permission
    bits do not tell (root, read-only mounts, /proc and /sys accept `os.access` but refuse files)."""
    import tempfile

    try:
        fd, tmp = tempfile.mkstemp(prefix=".mmspec-write-check-", dir=folder)
    except OSError as err:
        parser.error(f"argument {flag}: {str(out)!r} is not writable ({err.strerror or err})")
    os.close(fd)
    Path(tmp).unlink(missing_ok=True)


def check_output_folder(parser, flag, path):
    """Usage error unless `path` is a writable folder; a missing folder (and its missing parents) is created here,
    before any work (for outputs a command creates itself: run folders, files inside them), so that a folder
    that cannot be made (an unwritable or system folder) is a usage error naming `flag` and the path."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        parser.error(f"argument {flag}: {str(path)!r} is not a folder")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        parser.error(f"argument {flag}: {str(existing)!r} is not a folder, so {str(path)!r} cannot be created")
    if not os.access(existing, os.W_OK | os.X_OK):
        parser.error(f"argument {flag}: {str(existing)!r} is not writable")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.error(f"argument {flag}: cannot create the folder {str(path)!r} ({err.strerror or err})")
    _probe_write(parser, flag, path, path)


def check_device(parser, device, flag="--device"):
    """Usage error unless `device` names a torch device that exists here (`mmspec.checks.check_device`)."""
    from mmspec.checks import check_device as check

    try:
        check(device, name=flag)
    except ValueError as err:
        parser.error(f"argument {err}")


def check_zoo_folders(parser, zoo, names, flag="--zoo"):
    """Usage error unless each `zoo/name` folder has a `config.json` (the default `--zoo` is the shipped zoo,
    `DEFAULT_ZOO`, wherever the command is run from)."""
    for name in names:
        if not (Path(zoo) / name / "config.json").is_file():
            parser.error(f"argument {flag}: {str(Path(zoo) / name)!r} is not a model folder (no config.json)")


def check_generate_args(parser, args):
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


def generate(args):
    """Run `mmspec generate` on parsed, checked arguments (`check_generate_args`); prints and returns the report.

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


def generate_main(argv=None):
    parser = argparse.ArgumentParser(
        prog="mmspec generate", description=COMMANDS["generate"][1], formatter_class=HelpFormatter
    )
    _generate_args(parser)
    args = parser.parse_args(argv)
    check_generate_args(parser, args)
    logging.basicConfig(level=logging.WARNING)
    try:
        generate(args)
    except ZooError as err:
        parser.error(f"argument --zoo: {err}")
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
