"""The free-form VLM workload: open prompts about the digit canvases (`mmspec.data.canvases`), split into train /
held-out by canvas AND by prompt template.

Five kinds of prompt (`KINDS`), a few templates each (`TEMPLATES`):
- ``detail``: describe the image in detail; ``story``: a story about the digits; ``layout``: explain the 2x2 layout;
- ``compare``: compare two digits named from the canvas ("the 3 at the top left and the 7 at the bottom right";
  only canvases with at least 2 digits);
- ``follow-up``: a two-turn conversation (`messages`): a first question with its grounded answer (`make_qa`'s
  templated answer, as if the model had given it), then an open follow-up question; the model answers the last turn.

Split: canvases of the train split draw MNIST *train* digits, held-out canvases MNIST *test* digits (the same digits
`mmspec bench vlm` holds out); templates are split per kind by a seeded permutation (`split_templates`,
`HELD_OUT_PER_KIND` of every kind held out), so no held-out template or canvas digit is seen in training. The split
seed is fixed (`SPLIT_SEED`) so that `vlm-answers` and `bench vlm` agree whatever their canvas seeds.

Examples:
    >>> layouts, canvases, prompts = sample_prompts(6, "held-out", seed=0, min_digits=2)
    >>> prompts[0].messages  # a conversation in the processor's chat format, the image in the first user turn
"""

import logging
import numbers
from dataclasses import dataclass

import torch

from mmspec.data.canvases import POSITIONS, Layout, make_qa


logger = logging.getLogger(__name__)

KINDS = ("detail", "story", "layout", "compare", "follow-up")
SPLITS = ("train", "held-out")
MNIST_SPLIT = {"train": "train", "held-out": "test"}  # the MNIST split a canvas of each split draws its digits from
SPLIT_SEED = 19  # the template split; fixed so that every caller sees the same one
HELD_OUT_PER_KIND = 1

# compare: {a} and {b} name two digits of the canvas ("3 at the top left"); follow-up: (first kind of `make_qa`,
# follow-up question), "{p}" a filled cell of the canvas
TEMPLATES: dict[str, tuple] = {
    "detail": (
        "Describe the image in detail.",
        "Give a detailed description of everything you see in this image.",
        "Describe each digit in the image: where it is, its shape and its strokes.",
        "Look closely at the image and describe it thoroughly.",
    ),
    "story": (
        "Tell a story about the digits in the image.",
        "Write a short story in which the digits in this image are the characters.",
        "Invent a fairy tale about the digits you see in the image.",
        "Tell a funny story about these digits.",
    ),
    "layout": (
        "Explain the layout of the image.",
        "Explain where each digit is placed and which cells of the grid are empty.",
        "How are the digits arranged in the image? Explain in detail.",
        "Walk through the grid of this image cell by cell.",
    ),
    "compare": (
        "Compare the {a} and the {b} in the image.",
        "How does the {a} differ from the {b}?",
        "What do the {a} and the {b} have in common, and how are they different?",
        "Compare the {a} with the {b}: their shapes, sizes and strokes.",
    ),
    "follow-up": (
        ("describe", "Now tell a story about these digits."),
        ("what", "Explain in detail how each of them is written."),
        ("count", "Describe where each of them is and what is next to it."),
        ("which", "Tell me more about that digit and the digits around it."),
    ),
}


@dataclass(frozen=True)
class FreeFormPrompt:
    """One prompt of the free-form workload: its `kind`, `template` id ("kind/index"), the conversation `messages`
    (chat format; the image item in the first user turn) and `text`, the last user turn (what is answered)."""

    kind: str
    template: str
    messages: list
    text: str


def template_ids(kind: str | None = None) -> list[str]:
    """Every template id ("kind/index"), or those of `kind`."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind={kind!r}: use one of {KINDS}")
    return [f"{k}/{i}" for k in KINDS if kind in (None, k) for i in range(len(TEMPLATES[k]))]


def split_templates(seed: int = SPLIT_SEED, held_out_per_kind: int = HELD_OUT_PER_KIND) -> dict[str, list[str]]:
    """{"train": ids, "held-out": ids}: per kind, a seeded permutation of its templates; the first
    `held_out_per_kind` are held out. Deterministic given `seed`.

    Raises:
        ValueError: `held_out_per_kind` not in [1, templates per kind - 1] (each side needs every kind).
    """
    fewest = min(len(t) for t in TEMPLATES.values())
    if (
        isinstance(held_out_per_kind, bool)
        or not isinstance(held_out_per_kind, numbers.Integral)
        or not 1 <= held_out_per_kind < fewest
    ):
        raise ValueError(f"held_out_per_kind={held_out_per_kind!r}: must be an int in [1, {fewest - 1}] (every kind "
                         "needs templates on both sides)")  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    out = {"train": [], "held-out": []}
    for kind in KINDS:
        ids = template_ids(kind)
        order = torch.randperm(len(ids), generator=generator).tolist()
        out["held-out"] += sorted(ids[i] for i in order[:held_out_per_kind])
        out["train"] += sorted(ids[i] for i in order[held_out_per_kind:])
    return out


def _template(template_id: str):
    kind, _, index = template_id.partition("/")
    if kind not in KINDS or not index.isdigit() or int(index) >= len(TEMPLATES[kind]):
        raise ValueError(f"template {template_id!r}: not one of {template_ids()}")
    return kind, TEMPLATES[kind][int(index)]


def answerable(template_id: str, layout: Layout) -> bool:
    """Whether `template_id` can be asked about `layout` (compare: at least two digits)."""
    kind, _ = _template(template_id)
    return layout.count >= 2 if kind == "compare" else layout.count >= 1


def digit_name(layout: Layout, cell: int) -> str:
    """ "3 at the top left": the digit of `cell` and where it is."""
    digit = layout.cells[cell]
    if digit is None:
        raise ValueError(f"cell {POSITIONS[cell]!r} is empty")
    return f"{digit.label} at the {POSITIONS[cell]}"


def make_prompt(layout: Layout, template_id: str, generator: torch.Generator) -> FreeFormPrompt:
    """The prompt of `template_id` about `layout` (compare: two random filled cells; follow-up "which": a random
    filled cell).

    Raises:
        ValueError: an unknown template, or one `layout` cannot answer (`answerable`).
    """
    kind, template = _template(template_id)
    if not answerable(template_id, layout):
        raise ValueError(f"template {template_id!r} needs at least 2 digits, the canvas has {layout.count}")
    image = {"type": "image"}
    if kind == "follow-up":
        first_kind, follow = template
        question, answer = make_qa(layout, first_kind, generator)
        messages = [
            {"role": "user", "content": [image, {"type": "text", "text": question}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            {"role": "user", "content": [{"type": "text", "text": follow}]},
        ]
        return FreeFormPrompt(kind, template_id, messages, follow)
    if kind == "compare":
        filled = layout.filled
        a, b = sorted(filled[i] for i in torch.randperm(len(filled), generator=generator)[:2].tolist())
        text = template.format(a=digit_name(layout, a), b=digit_name(layout, b))
    else:
        text = template
    return FreeFormPrompt(kind, template_id, [{"role": "user", "content": [image, {"type": "text", "text": text}]}],
                          text)  # fmt: skip


def check_request(split: str, num) -> None:
    """ValueError naming the argument: `split` not in `SPLITS`, or `num` not a positive int (canvases)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: use one of {SPLITS}")
    if isinstance(num, bool) or not isinstance(num, numbers.Integral) or num < 1:
        raise ValueError(f"num={num!r}: must be a positive int (canvases)")


def sample_prompts(num: int, split: str, seed: int, min_digits: int = 1):
    """`num` canvases of `split` with one prompt each: (layouts, canvases float32 [num, 64, 64] in [0, 1],
    list[FreeFormPrompt]). Canvas i asks a template of kind `KINDS[i % 5]` (the next kind the canvas can answer),
    drawn from the split's templates. Deterministic given `seed`.

    Raises:
        ValueError: unknown `split`, `num` < 1; `min_digits` as `vlm_data.sample_layout` takes it.
    """
    from mmspec.data.canvases import mnist_digits, sample_batch

    check_request(split, num)
    generator = torch.Generator().manual_seed(seed)
    images, labels = mnist_digits(MNIST_SPLIT[split])
    layouts, canvases = sample_batch(num, images, labels, generator, min_digits=min_digits)
    ids = split_templates()[split]
    prompts = []
    for i, layout in enumerate(layouts):
        for step in range(len(KINDS)):
            kind = KINDS[(i + step) % len(KINDS)]
            choices = [t for t in ids if t.startswith(kind + "/") and answerable(t, layout)]
            if choices:
                break
        pick = choices[int(torch.randint(len(choices), (), generator=generator))]
        prompts.append(make_prompt(layout, pick, generator))
    return layouts, canvases, prompts
