"""Acceptance maps: a sample's token grid drawn cell by cell from its `DecodeTrace`.

* Discrete images (`round_map`): each cell is filled with the colour of the verification round in which the token
  was emitted (round 0 = prefill; `round_colours`), and marked by its origin: a red cross on a `RESAMPLED` token (a
  draft was rejected there and the target's residual drew it), a white square in the middle of a `BONUS` token (every
  draft of its round was accepted, the target drew one more), a black square on the `PREFILL` token. Unmarked cells
  are accepted drafts, so runs of one colour show what a single target forward emitted.
* Continuous tokens (`origin_map`): each cell is coloured by what happened to the token: proposed by the draft and
  accepted, proposed and resampled by the target, or decoded by the target alone (pre-fill steps / plain MAR).

Maps are PIL RGB images of `grid x grid` cells of `cell` pixels, upscaled with nearest neighbours to sit next to
the (equally upscaled) sample.
"""

import html

import numpy as np
from matplotlib import colormaps
from PIL import Image

from mmspec.decoding.trace import ACCEPTED, BONUS, NONE, PREFILL, RESAMPLED


__all__ = [
    "MARK_COLOURS",
    "ORIGIN_COLOURS",
    "origin_legend_html",
    "origin_map",
    "round_colours",
    "round_legend_html",
    "round_map",
    "upscale",
]

MARK_COLOURS = {RESAMPLED: (230, 20, 20), BONUS: (255, 255, 255), PREFILL: (0, 0, 0)}
NOT_GENERATED = (128, 128, 128)
# continuous maps: origin -> (colour, label)
ORIGIN_COLOURS = {
    ACCEPTED: ((40, 170, 70), "proposed by the draft, accepted"),
    RESAMPLED: ((220, 60, 40), "proposed by the draft, resampled by the target"),
    PREFILL: ((70, 110, 200), "target alone (pre-fill)"),
    BONUS: ((150, 150, 150), "target alone (plain MAR)"),
}


def round_colours(num_rounds):
    """`[num_rounds, 3]` uint8: the colour of rounds `0 .. num_rounds - 1` (viridis, early = dark, late = light)."""
    if num_rounds < 1:
        raise ValueError(f"num_rounds must be >= 1, got {num_rounds}")
    steps = np.linspace(0.0, 1.0, num_rounds) if num_rounds > 1 else np.zeros(1)
    return (colormaps["viridis"](steps)[:, :3] * 255).round().astype(np.uint8)


def _grid_side(n):
    side = int(round(n**0.5))
    if side * side != n:
        raise ValueError(f"a trace row of {n} tokens is not a square token grid")
    return side


def _row(tensor, row):
    values = tensor[row].detach().cpu().numpy()
    return values.astype(np.int64)


def _mark(cell_pixels, origin, cell):
    """Draw the origin mark of one cell in place (`cell_pixels`: `[cell, cell, 3]`)."""
    if origin == RESAMPLED:
        idx = np.arange(cell)
        for offset in (-1, 0, 1):  # a 3-pixel-wide cross
            ok = (idx + offset >= 0) & (idx + offset < cell)
            cell_pixels[idx[ok], (idx + offset)[ok]] = MARK_COLOURS[RESAMPLED]
            cell_pixels[idx[ok], (cell - 1 - idx - offset)[ok]] = MARK_COLOURS[RESAMPLED]
    elif origin in (BONUS, PREFILL):
        lo, hi = cell * 3 // 8, cell - cell * 3 // 8
        cell_pixels[lo:hi, lo:hi] = MARK_COLOURS[origin]


def round_map(trace, row=0, cell=32):
    """The discrete acceptance map of batch row `row`: `PIL.Image` RGB, cells coloured by round, marked by origin."""
    rounds, origins = _row(trace.round, row), _row(trace.origin, row)
    side = _grid_side(rounds.size)
    palette = round_colours(max(int(rounds.max()) + 1, 1))
    pixels = np.zeros((side * cell, side * cell, 3), dtype=np.uint8)
    for i, (r, origin) in enumerate(zip(rounds, origins)):
        y, x = divmod(i, side)
        block = pixels[y * cell : (y + 1) * cell, x * cell : (x + 1) * cell]
        block[:] = NOT_GENERATED if origin == NONE else palette[r]
        _mark(block, origin, cell)
    return Image.fromarray(pixels, "RGB")


def origin_map(trace, row=0, cell=32):
    """The continuous-token map of batch row `row`: `PIL.Image` RGB, cells coloured by origin (`ORIGIN_COLOURS`)."""
    origins = _row(trace.origin, row)
    side = _grid_side(origins.size)
    pixels = np.zeros((side * cell, side * cell, 3), dtype=np.uint8)
    for i, origin in enumerate(origins):
        y, x = divmod(i, side)
        colour = ORIGIN_COLOURS[origin][0] if origin in ORIGIN_COLOURS else NOT_GENERATED
        pixels[y * cell : (y + 1) * cell, x * cell : (x + 1) * cell] = colour
    return Image.fromarray(pixels, "RGB")


def upscale(image, size=256):
    """A sample (or map) resized to `size` x `size` with nearest neighbours (token cells stay sharp)."""
    return image.convert("RGB").resize((size, size), Image.NEAREST)


def _swatch(colour, label):
    rgb = "rgb({}, {}, {})".format(*colour)
    return (f'<span style="display:inline-block;width:12px;height:12px;background:{rgb};border:1px solid #888;'
            f'margin:0 4px 0 10px;vertical-align:middle"></span>{html.escape(label)}')  # fmt: skip


def round_legend_html(num_rounds):
    """Legend of `round_map` for a trace with `num_rounds` rounds."""
    palette = round_colours(max(num_rounds, 1))
    parts = [_swatch(palette[0], "round 0"), _swatch(palette[-1], f"round {max(num_rounds - 1, 0)}"),
             _swatch(MARK_COLOURS[RESAMPLED], "cross: resampled (draft rejected)"),
             _swatch(MARK_COLOURS[BONUS], "white square: bonus"), _swatch(MARK_COLOURS[PREFILL], "black: prefill"),
             "&nbsp; unmarked: accepted draft"]  # fmt: skip
    return '<div class="mmspec-legend">' + "".join(parts) + "</div>"


def origin_legend_html():
    """Legend of `origin_map`."""
    parts = [_swatch(colour, label) for colour, label in ORIGIN_COLOURS.values()]
    return '<div class="mmspec-legend">' + "".join(parts) + "</div>"
