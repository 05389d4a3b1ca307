"""The dense-readout workload (`mmspec.data.grids`): 4x4 grids of the split's own digits, a split disjoint by canvas
and template, answers that state every cell, and a scorer that reads them back (and counts every wrong cell)."""

import pytest
import torch

from mmspec.data import grids
from mmspec.data.canvases import draw_digit, mnist_digits


def test_template_split_is_disjoint_covers_every_kind_and_is_fixed():
    split = grids.split_templates()
    train, held = set(split["train"]), set(split["held-out"])
    assert not train & held and train | held == set(grids.template_ids())
    assert sorted(t.split("/")[0] for t in held) == sorted(grids.KINDS)  # one held out of every kind
    assert grids.split_templates() == split
    assert any(grids.split_templates(seed) != split for seed in range(5))
    pool = {f"{k}/{i}" for k in grids.KINDS for i in range(grids.SPLIT_POOL)}
    assert held <= pool  # drawn among the workload's first four of each kind; the paraphrases only ever train
    assert all(len(grids.template_ids(k)) - 1 >= 8 for k in grids.KINDS)  # many phrasings of each kind to train on


def test_training_paraphrases_are_distinct_from_the_held_out_templates():
    texts = {t: grids.TEMPLATES[t.split("/")[0]][int(t.split("/")[1])] for t in grids.template_ids()}
    assert len(set(texts.values())) == len(texts)
    held = grids.split_templates()["held-out"]
    paraphrases = [t for t in grids.template_ids() if int(t.split("/")[1]) >= grids.SPLIT_POOL]
    for h in held:  # no paraphrase is a held-out template in other words' clothing: no shared 4-word run
        words = texts[h].lower().rstrip(".?").split()
        runs = {" ".join(words[i : i + 4]) for i in range(len(words) - 3)}
        for t in paraphrases:
            assert not any(r in texts[t].lower() for r in runs), (h, t)


def test_render_puts_every_digit_in_its_own_cell():
    images, labels = mnist_digits("test")
    layout = grids.sample_layout(labels, torch.Generator().manual_seed(0))
    canvas = grids.render(layout, images)
    assert canvas.shape == (grids.CANVAS, grids.CANVAS) == (128, 128)
    for k, d in enumerate(layout.cells):
        cell = canvas[(k // 4) * 32 : (k // 4 + 1) * 32, (k % 4) * 32 : (k % 4 + 1) * 32]
        y, x = d.offset
        drawn = (draw_digit(images[d.index], d.size, d.thickness) * 255).round() / 255
        assert torch.equal(cell[y : y + d.size, x : x + d.size], drawn)
        assert d.label == int(labels[d.index])
        outside = cell.clone()
        outside[y : y + d.size, x : x + d.size] = 0
        assert outside.abs().sum() == 0  # no ink of another cell spills in


@pytest.mark.parametrize("split", grids.SPLITS)
def test_prompts_use_only_their_split_s_templates_and_digits(split):
    held = set(grids.split_templates()["held-out"])
    layouts, canvases, prompts = grids.sample_prompts(16, split, seed=3)
    assert [p.kind for p in prompts] == list(grids.KINDS) * 4
    assert all((p.template in held) == (split == "held-out") for p in prompts)
    images, _ = mnist_digits(grids.MNIST_SPLIT[split])
    for layout, canvas in zip(layouts[:4], canvases[:4]):
        assert torch.equal(grids.render(layout, images), canvas)
    other = grids.sample_prompts(16, "train" if split == "held-out" else "held-out", seed=3)[1]
    assert not any(torch.equal(a, b) for a in canvases for b in other)


def test_prompts_are_deterministic_given_the_seed():
    a, b, c = (grids.sample_prompts(6, "held-out", seed=s) for s in (7, 7, 8))
    assert a[0] == b[0] and a[2] == b[2] and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1])


def test_answers_state_every_cell_and_score_reads_them_back():
    layouts, _, prompts = grids.sample_prompts(40, "train", seed=1)
    for layout, prompt in zip(layouts, prompts):
        text = grids.answer(layout, prompt)
        follows = None if prompt.kind == "find" else True
        assert grids.score(layout, prompt, text) == {"digits": 16, "correct": 16, "follows": follows, "exact": True}
        if prompt.kind != "find":
            stated, form = grids.read_grid(text)
            assert stated == {(r, c): layout.label(r, c) for r in range(1, 5) for c in range(1, 5)}
            assert form == prompt.kind


@pytest.mark.parametrize("kind", ["rows", "columns", "list"])
def test_score_counts_each_wrong_or_missing_cell(kind):
    layouts, _, prompts = grids.sample_prompts(4, "train", seed=2)
    i = grids.KINDS.index(kind)
    layout, prompt = layouts[i], prompts[i]
    right = grids.answer(layout, prompt)
    wrong_label = (layout.label(2, 3) + 1) % 10
    if kind == "rows":
        row = " ".join(str(layout.label(2, c)) if c != 3 else str(wrong_label) for c in range(1, 5))
        wrong = right.replace(f"Row 2: {' '.join(str(layout.label(2, c)) for c in range(1, 5))}.", f"Row 2: {row}.")
        cut = right.split(" Row 4:")[0]  # row 4 missing
    elif kind == "columns":
        col = " ".join(str(layout.label(r, 3)) if r != 2 else str(wrong_label) for r in range(1, 5))
        wrong = right.replace(
            f"Column 3: {' '.join(str(layout.label(r, 3)) for r in range(1, 5))}.", f"Column 3: {col}."
        )
        cut = right.split(" Column 4:")[0]
    else:
        wrong = right.replace(f"Row 2, column 3: {layout.label(2, 3)}.", f"Row 2, column 3: {wrong_label}.")
        cut = right.split(" Row 4, column 1:")[0]
    assert wrong != right
    assert grids.score(layout, prompt, wrong) == {"digits": 16, "correct": 15, "follows": True, "exact": False}
    assert grids.score(layout, prompt, cut)["correct"] == 12


def test_score_reads_digits_whatever_their_separators():
    layouts, _, prompts = grids.sample_prompts(4, "train", seed=2)
    layout, prompt = layouts[0], prompts[0]  # rows
    commas = " ".join(f"row {r}: {', '.join(str(layout.label(r, c)) for c in range(1, 5))}," for r in range(1, 5))
    assert grids.score(layout, prompt, commas)["correct"] == 16
    run_on = f"Row 1: {' '.join(str(layout.label(1, c)) for c in range(1, 5))} 7 7 7 7 7."  # 4 digits read, no more
    assert grids.read_grid(run_on) == ({(1, c): layout.label(1, c) for c in range(1, 5)}, "rows")


def test_an_answer_in_another_form_reads_its_cells_but_does_not_follow_the_prompt():
    """Rows asked, columns (or cells) given: every cell read right counts, `follows` and `exact` are False; a cell
    statement's "column c: d" is never read as a column."""
    layouts, _, prompts = grids.sample_prompts(4, "train", seed=6)
    layout, rows_prompt = layouts[0], prompts[0]
    assert rows_prompt.kind == "rows"
    for other in ("columns", "list"):
        text = grids.answer(layout, grids.make_prompt(layout, f"{other}/0", torch.Generator()))
        got = grids.score(layout, rows_prompt, text)
        assert got == {"digits": 16, "correct": 16, "follows": False, "exact": False}, (other, text)
    one = f"Row 2, column 3: {layout.label(2, 3)}."
    assert grids.read_grid(one) == ({(2, 3): layout.label(2, 3)}, "list")


def test_find_answers_name_exactly_the_cells_holding_the_digit():
    layouts, _, prompts = grids.sample_prompts(80, "held-out", seed=4)
    finds = [(lay, p) for lay, p in zip(layouts, prompts) if p.kind == "find"]
    absent = present = 0
    for layout, prompt in finds:
        d = grids.asked_digit(prompt)
        cells = [(r, c) for r in range(1, 5) for c in range(1, 5) if layout.label(r, c) == d]
        text = grids.answer(layout, prompt)
        if cells:
            present += 1
            assert all(f"row {r}, column {c}" in text for r, c in cells)
            missing_one = grids.score(layout, prompt, text.replace(f"row {cells[0][0]}, column {cells[0][1]}", ""))
            assert missing_one["correct"] == 15 and not missing_one["exact"]
        else:
            absent += 1
            assert text == f"There is no {d} in the grid."
    assert present and absent  # both kinds of answer occur


def test_a_grid_layout_needs_sixteen_digits():
    layout = grids.sample_layout(torch.arange(10), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="16 Digits"):
        grids.GridLayout(layout.cells[:15])
    with pytest.raises(ValueError, match="split"):
        grids.sample_prompts(2, "val", seed=0)
