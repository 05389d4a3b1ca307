"""Instruction data of the offline VLM (`assets/mnist-vlm`): 64x64 canvases of real MNIST digits on a 2x2 grid.

A canvas is a 2x2 grid of 32x32 cells (top left, top right, bottom left, bottom right); 1-4 cells hold one MNIST digit
each, resized to 16-30 px, at a random offset inside its cell, drawn with thin / normal / thick strokes (a soft
threshold / the original / a 3x3 max-pool dilation). Digits come from MNIST train for training and from MNIST test for
held-out evaluation, so held-out digits are unseen. A `Layout` records what is where; questions and answers are
generated from it. Everything is deterministic given a `torch.Generator`.

Examples:
    >>> images, labels = mnist_digits("test")  # [N, 28, 28] ink in [0, 1], [N]
    >>> gen = torch.Generator().manual_seed(0)
    >>> layout = sample_layout(labels, gen)
    >>> canvas = render(layout, images)  # [64, 64] in [0, 1] (uint8 levels)
    >>> question, answer = make_qa(layout, "describe", gen)
    >>> image = to_pil(canvas)  # what `LlavaProcessor` takes
"""

import logging
import numbers
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F


logger = logging.getLogger(__name__)

CANVAS = 64
CELL = 32
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
MAX_DIGITS = len(POSITIONS)  # a canvas has 4 cells: at most 4 digits
THICKNESSES = ("thin", "normal", "thick")
QUESTION_KINDS = ("count", "which", "what", "describe")
NUMBER_WORDS = ("zero", "one", "two", "three", "four")
MIN_SIZE, MAX_SIZE = 16, 30


@dataclass(frozen=True)
class Digit:
    """One digit of a canvas: MNIST `label` (from `index` of its split), side `size` px, `thickness` (index into
    THICKNESSES) and its top-left `offset` (y, x) inside the 32x32 cell."""

    label: int
    index: int
    size: int
    thickness: int
    offset: tuple[int, int]


@dataclass(frozen=True)
class Layout:
    """`cells[k]`: the `Digit` in cell k (POSITIONS order) or None for an empty cell."""

    cells: tuple[Digit | None, Digit | None, Digit | None, Digit | None]

    @property
    def filled(self) -> list[int]:
        """Indices of the filled cells, in POSITIONS order."""
        return [k for k, d in enumerate(self.cells) if d is not None]

    @property
    def count(self) -> int:
        return len(self.filled)


@lru_cache(maxsize=2)
def mnist_digits(split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST `split` as ink in [0, 1]: (images float32 [N, 28, 28], labels int64 [N])."""
    from mmspec.data.mnist import load_mnist

    images, labels = load_mnist(split, pad=False)
    return (images[:, 0] + 1) / 2, labels


def sample_layout(
    labels: torch.Tensor,
    generator: torch.Generator,
    max_digits: int = 4,
    count_weights: torch.Tensor | None = None,
    min_digits: int = 1,
) -> Layout:
    """Draw 1..`max_digits` filled cells, each with a random digit of `labels` (its split), size, stroke, offset.

    `count_weights` [max_digits]: relative odds of 1..max_digits digits (default uniform). `min_digits`: redraw until
    the layout has at least that many digits (the same random stream as drawing and rejecting by hand).

    Raises:
        ValueError: `max_digits` / `min_digits` outside 1..4 (a canvas has 4 cells) or `min_digits > max_digits`, or
            `count_weights` that give no layout with `min_digits`..`max_digits` digits (it would never finish).
    """
    cells_per_canvas = len(POSITIONS)
    if (
        isinstance(max_digits, bool)
        or not isinstance(max_digits, numbers.Integral)
        or not 1 <= max_digits <= cells_per_canvas
    ):
        raise ValueError(f"max_digits={max_digits!r}: a canvas holds 1 to {cells_per_canvas} digits")
    if (
        isinstance(min_digits, bool)
        or not isinstance(min_digits, numbers.Integral)
        or not 1 <= min_digits <= max_digits
    ):
        raise ValueError(f"min_digits={min_digits!r}: must be an integer in [1, max_digits={max_digits}] (a canvas "
                         f"holds at most {cells_per_canvas} digits)")  # fmt: skip
    if count_weights is not None:
        weights = torch.as_tensor(count_weights, dtype=torch.float)
        if weights.dim() != 1 or len(weights) < max_digits:
            raise ValueError(f"count_weights: expected {max_digits} odds (1..max_digits digits), got shape "
                             f"{tuple(weights.shape)}")  # fmt: skip
        if not torch.isfinite(weights).all() or (weights < 0).any() or weights[min_digits - 1 : max_digits].sum() <= 0:
            raise ValueError(f"count_weights={weights.tolist()}: need finite odds >= 0, some > 0 for "
                             f"{min_digits}..{max_digits} digits")  # fmt: skip
        count_weights = weights
    while True:
        layout = _draw_layout(labels, generator, max_digits, count_weights)
        if layout.count >= min_digits:
            return layout


def _draw_layout(labels, generator, max_digits, count_weights) -> Layout:
    if count_weights is None:
        num = int(torch.randint(1, max_digits + 1, (), generator=generator))
    else:
        num = int(torch.multinomial(count_weights[:max_digits].float(), 1, generator=generator)) + 1
    chosen = set(torch.randperm(4, generator=generator)[:num].tolist())
    cells = []
    for k in range(4):
        if k not in chosen:
            cells.append(None)
            continue
        cells.append(random_digit(labels, generator))
    return Layout(tuple(cells))


def random_digit(labels: torch.Tensor, generator: torch.Generator) -> Digit:
    """One digit for a cell: a random MNIST image of `labels` (its split), side, stroke and offset in the cell."""
    index = int(torch.randint(len(labels), (), generator=generator))
    size = int(torch.randint(MIN_SIZE, MAX_SIZE + 1, (), generator=generator))
    thickness = int(torch.randint(len(THICKNESSES), (), generator=generator))
    y, x = torch.randint(CELL - size + 1, (2,), generator=generator).tolist()
    return Digit(int(labels[index]), index, size, thickness, (y, x))


def draw_digit(image: torch.Tensor, size: int, thickness: int) -> torch.Tensor:
    """[28, 28] ink in [0, 1] -> [size, size]: bilinear resize, then thin (soft threshold) / normal / thick (dilation)."""
    x = F.interpolate(image[None, None], size=(size, size), mode="bilinear", align_corners=False, antialias=True)
    if THICKNESSES[thickness] == "thin":
        x = ((x - 0.45) / 0.4).clamp(0, 1)
    elif THICKNESSES[thickness] == "thick":
        x = F.max_pool2d(x, 3, stride=1, padding=1)
    return x[0, 0].clamp(0, 1)


def render(layout: Layout, images: torch.Tensor) -> torch.Tensor:
    """The canvas [64, 64] in [0, 1] (white ink on black, quantized to uint8 levels) of `layout` over `images`."""
    canvas = torch.zeros(CANVAS, CANVAS)
    for k, digit in enumerate(layout.cells):
        if digit is None:
            continue
        y = (k // 2) * CELL + digit.offset[0]
        x = (k % 2) * CELL + digit.offset[1]
        canvas[y : y + digit.size, x : x + digit.size] = draw_digit(images[digit.index], digit.size, digit.thickness)
    return (canvas * 255).round() / 255


def sample_batch(
    num: int,
    images: torch.Tensor,
    labels: torch.Tensor,
    generator: torch.Generator,
    count_weights: torch.Tensor | None = None,
    min_digits: int = 1,
):
    """`num` random layouts (at least `min_digits` digits each) and their canvases: (list[Layout], float32
    [num, 64, 64] in [0, 1])."""
    layouts = [
        sample_layout(labels, generator, count_weights=count_weights, min_digits=min_digits) for _ in range(num)
    ]
    return layouts, torch.stack([render(layout, images) for layout in layouts])


def to_pil(canvas: torch.Tensor):
    """[64, 64] in [0, 1] -> grayscale ("L") PIL image (the processor replicates it to RGB)."""
    from PIL import Image

    return Image.fromarray((canvas * 255).round().to(torch.uint8).numpy(), mode="L")


def article(label: int) -> str:
    """The digit with its indefinite article: "an 8", "a 7"."""
    return f"an {label}" if label == 8 else f"a {label}"


def join_words(words: list[str]) -> str:
    """["a", "b", "c"] -> "a, b and c"."""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def count_sentence(layout: Layout) -> str:
    n = layout.count
    return "There is one digit in the image." if n == 1 else f"There are {NUMBER_WORDS[n]} digits in the image."


def which_question(cell: int) -> str:
    return f"Which digit is at the {POSITIONS[cell]}?"


def make_qa(layout: Layout, kind: str, generator: torch.Generator | None = None, cell: int | None = None):
    """(question, answer) of `kind` (QUESTION_KINDS) about `layout`; "which" asks about `cell` or a random filled one."""
    if kind == "count":
        return "How many digits are in the image?", count_sentence(layout)
    if kind == "which":
        if cell is None:
            filled = layout.filled
            cell = filled[int(torch.randint(len(filled), (), generator=generator))]
        digit = layout.cells[cell]
        if digit is None:
            raise ValueError(f"cell {POSITIONS[cell]!r} is empty")
        return which_question(cell), f"The digit at the {POSITIONS[cell]} is {article(digit.label)}."
    if kind == "what":
        digits = [article(layout.cells[k].label) for k in layout.filled]
        return "What digits do you see?", f"I see {join_words(digits)}."
    if kind == "describe":
        parts = [count_sentence(layout)]
        for k in layout.filled:
            d = layout.cells[k]
            parts.append(
                f"At the {POSITIONS[k]} there is {article(d.label)} written with {THICKNESSES[d.thickness]} strokes."
            )
        return "Describe the image.", " ".join(parts)
    raise ValueError(f"kind={kind!r}: use one of {QUESTION_KINDS}")


def held_out_canvases(num, seed, min_digits=3):
    """`num` PIL canvases of MNIST test digits with at least `min_digits` digits (long descriptions; a canvas holds
    at most `MAX_DIGITS`)."""
    if isinstance(min_digits, bool) or not isinstance(min_digits, int) or not 1 <= min_digits <= MAX_DIGITS:
        raise ValueError(f"min_digits must be an int in [1, {MAX_DIGITS}] (digits a canvas holds), got {min_digits!r}")

    images, labels = mnist_digits("test")
    generator = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < num:
        layout = sample_layout(labels, generator)
        if len(layout.filled) >= min_digits:
            out.append(to_pil(render(layout, images)))
    return out
