"""What a demo user typed, parsed and checked: every failure is a `ValueError` / `TypeError` whose message names
the field (the app shows it as it is). Knob values go through the registry's own check, `mmspec.methods.check_knob`.
"""

import math
import re
from pathlib import Path

from mmspec.cli.args import MAX_SEED
from mmspec.methods import KNOBS, check_knob


__all__ = ["MAX_SEED", "load_image", "page_message", "parse_int", "parse_knobs", "parse_seed", "upload_refusal"]


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


def upload_refusal(name=None):
    """The one message for an upload that cannot be read as an image (not an image, a folder, a missing file): it
    names the client's own file name (`name`, basename only), never a server path or the exception's text."""
    shown = Path(name).name if isinstance(name, str) and name.strip() else ""
    return f"image upload: {shown!r} is not an image file" if shown else "image upload: the file is not an image"


# a path (absolute, home or ../ relative; POSIX or Windows): quoted (spaces and all) or bare (up to a blank)
_QUOTED_PATH = re.compile(r"""(['"])(?:[A-Za-z]:|~|\.{1,2})?[/\\].*?\1""")
_BARE_PATH = re.compile(r"""(?<![\w.\-])(?:[A-Za-z]:|~|\.{1,2})?[/\\][^\s'"]*""")


def page_message(text):
    """`text` (an error message) with every path masked: messages shown on the page name no server path."""
    text = _QUOTED_PATH.sub(lambda m: f"{m.group(1)}<path>{m.group(1)}", str(text))
    return _BARE_PATH.sub("<path>", text)


def load_image(image):
    """An image file (path) or PIL image -> RGB `PIL.Image`. Anything PIL cannot open (not an image, a folder, a
    missing file) is one `ValueError` naming the file's base name only (`upload_refusal`)."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if not isinstance(image, (str, Path)):
        raise ValueError(f"image upload: expected an image file or a PIL image, got {type(image).__name__}")
    try:
        with Image.open(image) as opened:
            opened.load()
            return opened.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError):  # UnidentifiedImageError is an OSError
        raise ValueError(upload_refusal(str(image))) from None
