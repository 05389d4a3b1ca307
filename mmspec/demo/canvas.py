"""Is an uploaded image like the zoo VLM's training canvases? A cheap, honest out-of-distribution warning.

The zoo VLM (`mnist-vlm`) was trained only on `mmspec.data.canvases` canvases: square, 64 x 64, grey, white MNIST
digits on black, one digit at most per cell of a 2 x 2 grid, each digit inside its 32 x 32 cell. On anything else it
still answers, confidently and usually wrongly. `canvas_warning` flags what it can measure cheaply:

- the shape: not square (the processor squashes it);
- colour (canvases are grey) and polarity (canvases are mostly black: mean brightness <= 0.22 over 2000 canvases);
- no ink at all;
- the layout: ink across the 2 x 2 grid's cell borders. Resized to 64 x 64, 2000 random canvases have at most 9 ink
  pixels (> 0.5) in the 4-pixel band around the borders; 2000 lone MNIST test digits (the typical wrong upload,
  centred on the grid's crossing) have at least 29. The threshold sits between (`BORDER_INK_PIXELS`).

It can miss (a wrong image that passes every check) but does not cry wolf on a canvas, upscaled or not.
"""

import numpy as np

from mmspec.data.canvases import CANVAS, CELL


__all__ = ["BORDER_INK_PIXELS", "canvas_warning"]

BORDER_INK_PIXELS = 20  # ink pixels in the border band: canvases <= 9, lone MNIST digits >= 29 (2000 of each)
BORDER_BAND = 2  # pixels each side of a cell border
MAX_MEAN = 0.35  # mean brightness; canvases <= 0.22
MAX_ASPECT = 1.1  # long side / short side
MAX_COLOUR = 0.05  # mean |channel - grey|; canvases are grey (0)
INK = 0.5


def canvas_warning(image):
    """None if the PIL `image` looks like a zoo canvas; otherwise one line: why it does not, and what to expect."""
    reasons = []
    width, height = image.size
    if max(width, height) > MAX_ASPECT * min(width, height):
        reasons.append(f"it is {width}×{height}, not square")
    rgb = np.asarray(image.convert("RGB").resize((CANVAS, CANVAS)), dtype=np.float32) / 255
    grey = rgb.mean(axis=2)
    if np.abs(rgb - grey[..., None]).mean() > MAX_COLOUR:
        reasons.append("it is in colour")
    ink = grey > INK
    if grey.mean() > MAX_MEAN:
        reasons.append("it is mostly light (the canvases are white digits on black)")
    elif not ink.any():
        reasons.append("it has no digit-like ink")
    else:
        band = np.zeros_like(ink)
        band[CELL - BORDER_BAND : CELL + BORDER_BAND, :] = True
        band[:, CELL - BORDER_BAND : CELL + BORDER_BAND] = True
        if int((ink & band).sum()) > BORDER_INK_PIXELS:
            reasons.append("its ink crosses the 2×2 grid's cell borders (e.g. one large digit, not a canvas)")
    if not reasons:
        return None
    return (
        "This image is unlike the zoo model's training canvases (64×64, white MNIST digits on black, one per cell "
        f"of a 2×2 grid): {'; '.join(reasons)}. The tiny zoo model answers anyway; expect a confident wrong answer."
    )
