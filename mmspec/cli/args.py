"""The applications' argparse pieces: argument types, the method-knob flags, `--help`'s formatter and the command
tables' dispatcher, shared by `mmspec generate | vlm`, the benchmarks, the evaluation scripts, the training tasks
and the demo's launcher. The parse-time checks that look at more than one flag or at the disk are in
`mmspec.cli.checks`.

Every type raises `argparse.ArgumentTypeError`, so a bad value is a usage error (exit 2) naming the flag before
anything loads. Integers that cost memory or time have an upper bound (`int_in_range`; `seed_int` / `threads_int`
bounded by `MAX_SEED` / `MAX_THREADS`). The knob flags come from the registry `mmspec.methods`: one flag per
pipeline knob of `KNOBS` (`add_knob_arguments`; `knob_values` collects the set ones), range-checked by
`mmspec.methods.check_knob`. This module imports nothing heavy at import time (`mmspec --help` does not import
torch); the registry is imported when a parser needs it.
"""

import argparse
import importlib
import math

from mmspec.data.zoo import DEFAULT_ZOO as _DEFAULT_ZOO


__all__ = [
    "DEFAULT_ZOO",
    "MAX_BATCH",
    "MAX_SEED",
    "MAX_THREADS",
    "SPEEDUP_REPEATS",
    "HelpFormatter",
    "add_knob_arguments",
    "dispatch",
    "finite_float",
    "int_in_range",
    "int_list_in_range",
    "knob_values",
    "limited_float",
    "names_of",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "positive_int_list",
    "probability",
    "sampling_type",
    "seed_int",
    "threads_int",
    "weights_of",
]

# = mmspec.models.DEFAULT_ZOO (no torch import): the shipped zoo, wherever a command is run from
DEFAULT_ZOO = str(_DEFAULT_ZOO)  # `mmspec.data.zoo` (no torch import), as a flag default
# `torch.Generator.manual_seed` takes seeds below 2**64; commands add image / repeat offsets to `--seed`, so half of
# that range keeps every derived seed valid
MAX_SEED = 2**63 - 1
MAX_THREADS = 1024  # `--threads`: torch.set_num_threads far past any machine is a typo
MAX_BATCH = 1024  # images per pipeline call (KV caches grow with it)
SPEEDUP_REPEATS = 3  # `generate` / `vlm`: interleaved timed calls of each method behind `speedup_vs_plain`


# ----------------------------------------------------------------------------------------------------------------
# argparse types and help


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


def knob_values(args):
    """The knob flags of `add_knob_arguments` that were set, as pipeline keywords."""
    from mmspec.methods import KNOBS

    return {name: getattr(args, name) for name in KNOBS if getattr(args, name, None) is not None}


# ----------------------------------------------------------------------------------------------------------------
# command tables: `mmspec COMMAND`, `mmspec eval NAME`


def _entry_point(spec):
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


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
