"""The dense-readout VLM workload (issue 30): 128x128 canvases holding a full 4x4 grid of real MNIST digits, and
prompts whose answers read every digit out.

A canvas is a 4x4 grid of 32x32 cells, every cell holding one MNIST digit drawn as in `mmspec.data.canvases` (16-30 px,
random offset inside its cell, thin / normal / thick strokes): 16 digits per image. With the zoo VLM's 8x8 patches that
is 16x16 = 256 image tokens, 4x the 64 of the 2x2 canvases, and each cell is 4x4 patches as there.

Four kinds of prompt (`KINDS`), twelve templates each (`TEMPLATES`), every answer generated from the `GridLayout`:
- ``rows``: "Row 1: 7 3 0 5. Row 2: ..." (every second token a digit the text so far does not predict);
- ``columns``: the same, column by column;
- ``list``: "Row 1, column 1: 7. Row 1, column 2: 3. ..." (all 16 cells with their positions);
- ``find``: "Which cells hold a 7?" -> "There are two 7s: row 1, column 3 and row 4, column 2." (or "There is no 7 in
  the grid."); the digit asked is one on the canvas three times in four.

Split, as the free-form workload's (`mmspec.data.vlm_prompts`): train canvases draw MNIST *train* digits, held-out ones
MNIST *test* digits, and one template of every kind is held out (`split_templates`, a fixed seed, drawn among the
kind's first `SPLIT_POOL` templates, the workload's first four), so no held-out template or digit is seen in training.
The other eight of each kind are training paraphrases only (none shares a held-out template's wording): with three
phrasings a kind, a stage 2 that adapts the LM learned each phrasing's form by rote and answered held-out phrasings in
another kind's form (docs/zoo.md). `score` reads an answer back into digits and compares it with the layout.

Examples:
    >>> layouts, canvases, prompts = sample_prompts(4, "held-out", seed=0)  # canvases [4, 128, 128] in [0, 1]
    >>> prompts[0].text, answer(layouts[0], prompts[0])
    >>> score(layouts[0], prompts[0], "Row 1: 7 3 0 5. ...")  # {"digits": 16, "correct": ..., "exact": ...}
"""

import logging
import re
from dataclasses import dataclass

import torch

from mmspec.data.canvases import CELL, Digit, draw_digit, mnist_digits, random_digit
from mmspec.data.vlm_prompts import MNIST_SPLIT, FreeFormPrompt, check_request
from mmspec.data.vlm_prompts import SPLITS as SPLITS  # the same two splits, by canvas and by template


logger = logging.getLogger(__name__)

GRID = 4
CANVAS = GRID * CELL  # 128
CELLS = GRID * GRID
KINDS = ("rows", "columns", "list", "find")
SPLIT_SEED = 23  # the template split; fixed so that the trainers and the bench agree whatever their canvas seeds
SPLIT_POOL = 4  # the held-out template of a kind is one of its first SPLIT_POOL; the rest are training paraphrases
KIND_WEIGHTS = {"rows": 0.35, "columns": 0.2, "list": 0.2, "find": 0.25}  # the training mix
FIND_PRESENT = 0.75  # odds that a find prompt asks for a digit the canvas holds

TEMPLATES: dict[str, tuple[str, ...]] = {
    "rows": (
        "Read the grid row by row.",
        "Read out every row of the grid, from top to bottom.",
        "What digits are in each row of the grid?",
        "Transcribe the digits of the grid, one row at a time.",
        # training paraphrases (never held out)
        "Read each row of the grid aloud.",
        "Tell me the digits in every row.",
        "Go row by row and say the digits.",
        "Starting at the top, what are the digits of each row?",
        "Write down the rows of the grid.",
        "Spell out the grid, row after row.",
        "Which digits does each row contain?",
        "Say the four digits of every row, top row first.",
    ),
    "columns": (
        "Read the grid column by column.",
        "Read out every column of the grid, from left to right.",
        "What digits are in each column of the grid?",
        "Transcribe the digits of the grid, one column at a time.",
        "Read each column of the grid aloud.",
        "Tell me the digits in every column.",
        "Go column by column and say the digits.",
        "Starting at the left, what are the digits of each column?",
        "Write down the columns of the grid.",
        "Spell out the grid, column after column.",
        "Which digits does each column contain?",
        "Say the four digits of every column, leftmost column first.",
    ),
    "list": (
        "List every digit and its position.",
        "Name each digit in the grid with its row and column.",
        "Go through every cell of the grid and say which digit it holds.",
        "Give the position of every digit in the grid.",
        "For every cell, say its row, its column and its digit.",
        "Tell me the digit in each cell, with its row and column.",
        "Say which digit sits at each place in the grid.",
        "Describe the grid cell by cell.",
        "What digit is in each cell? Name the cells by row and column.",
        "Walk through the cells and name the digit of each.",
        "Map every cell of the grid to its digit.",
        "Report each cell's digit together with where it is.",
    ),
    "find": (
        "Which cells hold a {d}?",
        "Where are the {d}s in the grid?",
        "Find every {d} in the grid.",
        "List the positions of the digit {d}.",
        "In which cells is there a {d}?",
        "Show me where every {d} is.",
        "Locate the digit {d} in the grid.",
        "Which places in the grid contain a {d}?",
        "Point out each {d} in the grid.",
        "Name the cells where a {d} appears.",
        "Where does the digit {d} occur?",
        "Are there any {d}s? Say where.",
    ),
}


@dataclass(frozen=True)
class GridLayout:
    """`cells[k]`: the `Digit` of cell k in raster order (row `k // 4`, column `k % 4`); every cell is filled."""

    cells: tuple[Digit, ...]

    def __post_init__(self):
        if len(self.cells) != CELLS or any(not isinstance(d, Digit) for d in self.cells):
            raise ValueError(f"a grid layout holds {CELLS} Digits, got {len(self.cells)} cells")

    @property
    def labels(self) -> list[int]:
        return [d.label for d in self.cells]

    def label(self, row: int, column: int) -> int:
        """The digit at 1-based (`row`, `column`)."""
        return self.cells[(row - 1) * GRID + column - 1].label


def sample_layout(labels: torch.Tensor, generator: torch.Generator) -> GridLayout:
    """16 cells, each a random digit of `labels` (its split) with a random size, stroke and offset."""
    return GridLayout(tuple(random_digit(labels, generator) for _ in range(CELLS)))


def render(layout: GridLayout, images: torch.Tensor) -> torch.Tensor:
    """The canvas [128, 128] in [0, 1] (white ink on black, uint8 levels) of `layout` over `images` (its split)."""
    canvas = torch.zeros(CANVAS, CANVAS)
    for k, digit in enumerate(layout.cells):
        y = (k // GRID) * CELL + digit.offset[0]
        x = (k % GRID) * CELL + digit.offset[1]
        canvas[y : y + digit.size, x : x + digit.size] = draw_digit(images[digit.index], digit.size, digit.thickness)
    return (canvas * 255).round() / 255


def sample_batch(num: int, images: torch.Tensor, labels: torch.Tensor, generator: torch.Generator):
    """`num` random layouts and their canvases: (list[GridLayout], float32 [num, 128, 128] in [0, 1])."""
    layouts = [sample_layout(labels, generator) for _ in range(num)]
    return layouts, torch.stack([render(layout, images) for layout in layouts])


# ----------------------------------------------------------------------------- prompts and answers


def template_ids(kind: str | None = None) -> list[str]:
    """Every template id ("kind/index"), or those of `kind`."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind={kind!r}: use one of {KINDS}")
    return [f"{k}/{i}" for k in KINDS if kind in (None, k) for i in range(len(TEMPLATES[k]))]


def split_templates(seed: int = SPLIT_SEED) -> dict[str, list[str]]:
    """{"train": ids, "held-out": ids}: one template of every kind held out, by a seeded permutation of the kind's
    first `SPLIT_POOL` templates; every other template of the kind is a training one."""
    generator = torch.Generator().manual_seed(seed)
    out = {"train": [], "held-out": []}
    for kind in KINDS:
        ids = template_ids(kind)
        held = ids[torch.randperm(SPLIT_POOL, generator=generator).tolist()[0]]
        out["held-out"].append(held)
        out["train"] += sorted((i for i in ids if i != held), key=lambda i: int(i.partition("/")[2]))
    return out


def _template(template_id: str) -> tuple[str, str]:
    kind, _, index = template_id.partition("/")
    if kind not in KINDS or not index.isdigit() or int(index) >= len(TEMPLATES[kind]):
        raise ValueError(f"template {template_id!r}: not one of {template_ids()}")
    return kind, TEMPLATES[kind][int(index)]


def make_prompt(layout: GridLayout, template_id: str, generator: torch.Generator) -> FreeFormPrompt:
    """The prompt of `template_id` about `layout` (find: a digit of the canvas with odds `FIND_PRESENT`, else any)."""
    kind, template = _template(template_id)
    text = template
    if kind == "find":
        if float(torch.rand((), generator=generator)) < FIND_PRESENT:
            digit = layout.labels[int(torch.randint(CELLS, (), generator=generator))]
        else:
            digit = int(torch.randint(10, (), generator=generator))
        text = template.format(d=digit)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    return FreeFormPrompt(kind, template_id, messages, text)


def asked_digit(prompt: FreeFormPrompt) -> int:
    """The digit a find prompt asks about."""
    match = re.search(r"\d", prompt.text)
    if prompt.kind != "find" or match is None:
        raise ValueError(f"{prompt.text!r} is not a find prompt")
    return int(match.group())


def _position(row: int, column: int) -> str:
    return f"row {row}, column {column}"


def answer(layout: GridLayout, prompt: FreeFormPrompt) -> str:
    """The correct answer to `prompt` on `layout` (what stage 2 trains the target to say)."""
    grid = [[layout.label(r, c) for c in range(1, GRID + 1)] for r in range(1, GRID + 1)]
    if prompt.kind == "rows":
        return " ".join(f"Row {r + 1}: {' '.join(map(str, grid[r]))}." for r in range(GRID))
    if prompt.kind == "columns":
        return " ".join(f"Column {c + 1}: {' '.join(str(grid[r][c]) for r in range(GRID))}." for c in range(GRID))
    if prompt.kind == "list":
        return " ".join(f"Row {r + 1}, column {c + 1}: {grid[r][c]}." for r in range(GRID) for c in range(GRID))
    if prompt.kind == "find":
        d = asked_digit(prompt)
        where = [_position(r + 1, c + 1) for r in range(GRID) for c in range(GRID) if grid[r][c] == d]
        if not where:
            return f"There is no {d} in the grid."
        if len(where) == 1:
            return f"There is one {d}: {where[0]}."
        count = ("two", "three", "four", "five", "six")[len(where) - 2] if len(where) <= 6 else str(len(where))
        return f"There are {count} {d}s: {'; '.join(where[:-1])} and {where[-1]}."
    raise ValueError(f"kind {prompt.kind!r}: use one of {KINDS}")


def sample_prompts(num: int, split: str, seed: int):
    """`num` canvases of `split` with one prompt each: (layouts, canvases float32 [num, 128, 128],
    list[FreeFormPrompt]); canvas i asks a template of kind `KINDS[i % 4]`, drawn from the split's templates.
    Deterministic given `seed`.

    Raises:
        ValueError: unknown `split`, `num` < 1.
    """
    check_request(split, num)
    generator = torch.Generator().manual_seed(seed)
    images, labels = mnist_digits(MNIST_SPLIT[split])
    layouts, canvases = sample_batch(num, images, labels, generator)
    ids = split_templates()[split]
    prompts = []
    for i, layout in enumerate(layouts):
        choices = [t for t in ids if t.startswith(KINDS[i % len(KINDS)] + "/")]
        prompts.append(
            make_prompt(layout, choices[int(torch.randint(len(choices), (), generator=generator))], generator)
        )
    return layouts, canvases, prompts


def sample_training(num: int, images, labels, generator, kind_weights=None):
    """`num` training (layout, canvas, prompt) triples, kinds drawn by `kind_weights` (default `KIND_WEIGHTS`) over
    the train templates: (layouts, canvases [num, 128, 128], prompts)."""
    weights = torch.tensor([float((kind_weights or KIND_WEIGHTS)[k]) for k in KINDS])
    layouts, canvases = sample_batch(num, images, labels, generator)
    ids = split_templates()["train"]
    kinds = torch.multinomial(weights, num, replacement=True, generator=generator).tolist()
    prompts = []
    for layout, k in zip(layouts, kinds):
        choices = [t for t in ids if t.startswith(KINDS[k] + "/")]
        prompts.append(
            make_prompt(layout, choices[int(torch.randint(len(choices), (), generator=generator))], generator)
        )
    return layouts, canvases, prompts


# ----------------------------------------------------------------------------- scoring


# a cell statement ("Row 2, column 3: 5."), and a row / column statement with its first four digits, separated by
# spaces or commas ("Row 2: 8 7 4 9." or "row 2: 8, 7, 4, 9"): an answer is scored on what it reads, not on its
# punctuation, and in whichever of the three forms it states the cells
_CELL = re.compile(r"\b[Rr]ow ([1-4]),? column ([1-4]):\s*([0-9])")
_ROW = re.compile(r"\b(Row|Column|row|column) ([1-4]):((?:[ ,]*[0-9]){1,4})")
_WHERE = re.compile(r"\b[Rr]ow ([1-4]), column ([1-4])\b")
READ_KINDS = ("rows", "columns", "list")  # the kinds whose answers state every cell


def read_grid(text: str) -> tuple[dict[tuple[int, int], int], str | None]:
    """What an answer states: ({(row, column): digit}, the form it states it in: "list" (cell statements), "rows" /
    "columns" (row / column statements), None (none)). The first statement of a cell wins; cell statements are read
    first and taken out, so that their "column c: d" never reads as a column."""
    out: dict[tuple[int, int], int] = {}
    forms = []
    for r, c, d in _CELL.findall(text):
        out.setdefault((int(r), int(c)), int(d))
        forms.append("list")
    for axis, index, digits in _ROW.findall(_CELL.sub(" | ", text)):
        rows = axis.lower() == "row"
        for j, d in enumerate(re.findall(r"[0-9]", digits), start=1):
            out.setdefault((int(index), j) if rows else (j, int(index)), int(d))
        forms.append("rows" if rows else "columns")
    return out, (max(set(forms), key=forms.count) if forms else None)


def score(layout: GridLayout, prompt: FreeFormPrompt, text: str) -> dict:
    """How much of `layout` the answer `text` reads right.

    rows / columns / list: `digits` = 16, `correct` = cells stated with the right digit, in whichever form the answer
    states them (a missing cell is wrong), `follows` = the answer states them in the form asked (rows asked, rows
    given); find: `digits` = 16, `correct` = cells whose membership in the answer's positions is right (with no
    position named, every cell right when none holds the digit), `follows` = None. `exact`: the whole answer right
    (and, for the read kinds, in the form asked).
    """
    if prompt.kind == "find":
        d = asked_digit(prompt)
        truth = {(r, c) for r in range(1, GRID + 1) for c in range(1, GRID + 1) if layout.label(r, c) == d}
        named = {(int(r), int(c)) for r, c in _WHERE.findall(text)}
        correct = sum(((r, c) in truth) == ((r, c) in named) for r in range(1, GRID + 1) for c in range(1, GRID + 1))
        return {"digits": CELLS, "correct": correct, "follows": None, "exact": truth == named}
    if prompt.kind not in READ_KINDS:
        raise ValueError(f"kind {prompt.kind!r}: use one of {KINDS}")
    stated, form = read_grid(text)
    correct = sum(stated.get((r, c)) == layout.label(r, c) for r in range(1, GRID + 1) for c in range(1, GRID + 1))
    follows = form == prompt.kind
    return {"digits": CELLS, "correct": correct, "follows": follows, "exact": correct == CELLS and follows}
