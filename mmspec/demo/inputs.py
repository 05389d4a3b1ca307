"""What a demo user typed, parsed and checked: every failure is a `ValueError` / `TypeError` whose message names
the field (the app shows it as it is). Knob values go through the registry's own check, `mmspec.methods.check_knob`.
"""

import math
from pathlib import Path

from mmspec.cli.args import MAX_SEED
from mmspec.methods import KNOBS, check_knob


__all__ = ["MAX_SEED", "load_image", "parse_int", "parse_knobs", "parse_seed"]


def parse_int(name, value, low=None, high=None):
    """`value` (an int, a whole float from a number box, or text) as an int in `[low, high]`; `name` names the field."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{name} must be a whole number, got {text!r}") from None
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ValueError(f"{name} must be a whole number, got {value!r}")
        value = int(value)
    if not isinstance(value, int):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    if low is not None and value < low or high is not None and value > high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def parse_seed(value):
    """The seed field: a whole number in `[0, 2**63 - 1]`."""
    return parse_int("seed", value, 0, MAX_SEED)


def _knob_value(name, value):
    knob = KNOBS[name]
    if value is None or isinstance(value, str) and not value.strip():
        if knob.optional:
            return None
        raise ValueError(f"{name} needs a value ({knob.help})")
    if knob.kind is int and isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)  # number boxes send floats; 2.5 stays a float and check_knob refuses it
    elif knob.kind is int and isinstance(value, str):
        value = parse_int(name, value)
    elif knob.kind is float and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{name} must be a number, got {value!r}") from None
    return check_knob(name, value)


def parse_knobs(values):
    """`{knob name: widget value}` -> `{knob name: checked value}` (`check_knob`; None for an empty optional knob)."""
    unknown = sorted(set(values) - set(KNOBS))
    if unknown:
        raise ValueError(f"unknown knob(s) {unknown}; the registry has {sorted(KNOBS)}")
    return {name: _knob_value(name, value) for name, value in values.items()}


def load_image(path):
    """An uploaded file -> RGB `PIL.Image`; a file that is not an image is a `ValueError` naming the upload."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(path, Image.Image):
        return path.convert("RGB")
    if not isinstance(path, (str, Path)) or not Path(path).is_file():
        raise ValueError(f"image upload: no such file {path!r}")
    try:
        with Image.open(path) as image:
            image.load()
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as err:
        raise ValueError(f"image upload: {Path(path).name!r} is not an image PIL can read ({err})") from None
