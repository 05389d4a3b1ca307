"""MNIST prompts for text-to-image: per-image attributes from pixels and seeded prompts naming them.

Attributes (computed from the pixels of every image, thresholds from the `train` split only -- all rows if the codes
file has none):

* stroke thickness: the ink mass `sum(pixels in [0, 1])` of the image, compared with the tertiles of the ink mass of
  the *same digit class* on the train split (a "1" has far less ink than an "8"): below the first tertile "thin",
  above the second "thick", else "regular". Mass also grows a little with the digit's size; on MNIST (digits
  normalised to a 20x20 box) it is dominated by the pen width.
* slant: the shear of the ink distribution from second-order central image moments, `slant = -mu11 / mu02` with
  x to the right and y downwards (the horizontal drift of the ink per pixel going up: > 0 when the top leans to the
  right, like "/"), compared with the tertiles of the same digit class on the train split (the shape of a "7" alone
  gives it a negative moment slant): "slanted left" / "upright" / "slanted right".

Tertiles per class make each attribute value about one third of every digit class.

Prompts: every image gets `prompts_per_image` prompts drawn from a `torch.Generator(seed)`: one of `TEMPLATES`
(uniformly), the digit as a numeral ("7") or a word ("seven") with probability 1/2, and the image's own attribute
values where the template names them, e.g. "a handwritten 7", "the number three", "a thick handwritten seven",
"the digit 3, slanted to the right", "a thin, right-leaning 8".

The MiniLM features of the prompts and the captions file are built by `mmspec.train.captions`.

Examples:
    >>> mass, slant = ink_and_slant(images)  # images [N, 1, H, W] in [-1, 1]
    >>> thresholds = attribute_thresholds(images, labels)
    >>> thickness, slant_label = attribute_labels(images, labels, thresholds)
    >>> render_prompt(TEMPLATES[4], 7, numeral=False, thickness=2)  # 'a thick handwritten seven'
"""

import re

import torch
from torch import Tensor


THICKNESS = ("thin", "regular", "thick")
SLANT = ("slanted left", "upright", "slanted right")
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# phrases of the attribute values: after the digit ("..., slanted to the left") or before it ("a left-leaning 7")
SLANT_PHRASES = ("slanted to the left", "upright", "slanted to the right")
SLANT_ADJECTIVES = ("left-leaning", "upright", "right-leaning")

# {digit}: numeral or word; {thick}: THICKNESS; {slant}: SLANT_PHRASES; {slant_adj}: SLANT_ADJECTIVES
TEMPLATES = (
    "a handwritten {digit}",
    "the digit {digit}",
    "the number {digit}",
    "a picture of the digit {digit}",
    "a {thick} handwritten {digit}",
    "the digit {digit}, written with {thick} strokes",
    "a {thick} {digit}",
    "the digit {digit}, {slant}",
    "a {slant_adj} handwritten {digit}",
    "the number {digit}, {slant}",
    "a {thick} handwritten {digit}, {slant}",
    "a {thick}, {slant_adj} {digit}",
    "the digit {digit} in {thick} strokes, {slant}",
    "a {slant_adj} {digit} with {thick} strokes",
)


# ----------------------------------------------------------------------------- attributes
def ink_and_slant(images: Tensor) -> tuple[Tensor, Tensor]:
    """Ink mass and moment slant of every image.

    Args:
        images: `[N, 1, H, W]` (or `[N, H, W]`) in [-1, 1], background -1 (the toolkit's MNIST format).

    Returns:
        (mass float32 `[N]` = sum of the pixels mapped to [0, 1]; slant float32 `[N]` = `-mu11 / mu02`, > 0 when
        the top of the digit leans to the right; 0 for an empty image).
    """
    ink = ((images.float() + 1) / 2).clamp(0, 1)
    ink = ink.reshape(ink.shape[0], *ink.shape[-2:])
    h, w = ink.shape[-2:]
    ys = torch.arange(h, dtype=torch.float32)[:, None]
    xs = torch.arange(w, dtype=torch.float32)[None]
    mass = ink.sum((1, 2))
    safe = mass.clamp(min=1e-6)
    cx = (ink * xs).sum((1, 2)) / safe
    cy = (ink * ys).sum((1, 2)) / safe
    dx, dy = xs - cx[:, None, None], ys - cy[:, None, None]
    mu11 = (ink * dx * dy).sum((1, 2)) / safe
    mu02 = (ink * dy * dy).sum((1, 2)) / safe
    slant = torch.where(mu02 > 1e-6, -mu11 / mu02.clamp(min=1e-6), torch.zeros_like(mu11))
    return mass, slant


def attribute_thresholds(images: Tensor, labels: Tensor, num_classes: int = 10) -> dict[str, Tensor]:
    """Per-class tertiles of the ink mass and of the slant: `{"thickness": [C, 2], "slant": [C, 2]}` (float32).

    Raises:
        ValueError: a class in `range(num_classes)` has no image.
    """
    mass, slant = ink_and_slant(images)
    q = torch.tensor([1 / 3, 2 / 3])
    out = {"thickness": torch.zeros(num_classes, 2), "slant": torch.zeros(num_classes, 2)}
    for c in range(num_classes):
        rows = labels == c
        if not bool(rows.any()):
            raise ValueError(f"no image of class {c}: thresholds need every class")
        out["thickness"][c] = mass[rows].quantile(q)
        out["slant"][c] = slant[rows].quantile(q)
    return out


def attribute_labels(images: Tensor, labels: Tensor, thresholds: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """(thickness `[N]`, slant `[N]`) int64 in {0, 1, 2} (indices into THICKNESS / SLANT) with the per-class
    `thresholds` of `attribute_thresholds` (a value equal to a threshold goes to the lower bucket)."""
    mass, slant = ink_and_slant(images)
    t, s = thresholds["thickness"][labels], thresholds["slant"][labels]  # [N, 2]
    thickness = (mass[:, None] > t).sum(1)
    slant_label = (slant[:, None] > s).sum(1)
    return thickness.long(), slant_label.long()


# ----------------------------------------------------------------------------- prompts
def _articles(text: str) -> str:
    """'a' -> 'an' before a vowel sound ("an upright", "an 8", "an eight")."""
    return re.sub(r"\ba (?=[aeiou8])", "an ", text)


def render_prompt(template: str, digit: int, numeral: bool, thickness: int | None = None,
                  slant: int | None = None) -> str:  # fmt: skip
    """Fill one of `TEMPLATES` for `digit` (as "7" if `numeral` else "seven") and the attribute indices it names."""
    fields = {"digit": str(digit) if numeral else DIGIT_WORDS[digit]}
    if "{thick}" in template:
        fields["thick"] = THICKNESS[thickness]
    if "{slant}" in template:
        fields["slant"] = SLANT_PHRASES[slant]
    if "{slant_adj}" in template:
        fields["slant_adj"] = SLANT_ADJECTIVES[slant]
    return _articles(template.format(**fields))


def names_thickness(template: str) -> bool:
    return "{thick}" in template


def names_slant(template: str) -> bool:
    return "{slant}" in template or "{slant_adj}" in template


def make_prompts(labels: Tensor, thickness: Tensor, slant: Tensor, prompts_per_image: int, generator,
                 templates=TEMPLATES) -> tuple[list[str], Tensor, dict[str, Tensor]]:  # fmt: skip
    """Draw `prompts_per_image` prompts for every image (template uniform, numeral or word with probability 1/2).

    Args:
        labels, thickness, slant: `[N]` digits and attribute indices.
        prompts_per_image: K.
        generator: `torch.Generator`, the only source of randomness.
        templates: template strings (default `TEMPLATES`).

    Returns:
        (unique prompts `[P]` in order of first use, `prompt_index` int64 `[N, K]`, per-prompt metadata
        `{"prompt_digit", "prompt_thickness", "prompt_slant", "prompt_template"}` int64 `[P]`, -1 = not named).
    """
    n, k = len(labels), int(prompts_per_image)
    template_ids = torch.randint(len(templates), (n, k), generator=generator)
    numeral = torch.rand(n, k, generator=generator) < 0.5
    prompts, index, meta = [], {}, {"prompt_digit": [], "prompt_thickness": [], "prompt_slant": [],
                                    "prompt_template": []}  # fmt: skip
    prompt_index = torch.empty(n, k, dtype=torch.long)
    rows = zip(labels.tolist(), thickness.tolist(), slant.tolist(), template_ids.tolist(), numeral.tolist())
    for i, (digit, thick, sl, tids, nums) in enumerate(rows):
        for j, (tid, num) in enumerate(zip(tids, nums)):
            template = templates[tid]
            named_thick = thick if names_thickness(template) else -1
            named_slant = sl if names_slant(template) else -1
            text = render_prompt(template, digit, num, named_thick, named_slant)
            if text not in index:
                index[text] = len(prompts)
                prompts.append(text)
                for key, value in zip(meta, (digit, named_thick, named_slant, tid)):
                    meta[key].append(value)
            prompt_index[i, j] = index[text]
    return prompts, prompt_index, {key: torch.tensor(values, dtype=torch.long) for key, values in meta.items()}
