"""The free-form VLM workload (`mmspec.data.vlm_prompts`): a split disjoint by canvas and by template, deterministic,
and every prompt answerable on its canvas."""

import re

import pytest
import torch

from mmspec.data import vlm_prompts
from mmspec.data.canvases import POSITIONS, make_qa, mnist_digits, render, sample_layout
from mmspec.data.vlm_prompts import KINDS, make_prompt, sample_prompts, split_templates, template_ids


def test_template_split_is_disjoint_covers_every_kind_and_depends_on_its_seed():
    split = split_templates()
    train, held = set(split["train"]), set(split["held-out"])
    assert not train & held and train | held == set(template_ids())
    for kind in KINDS:  # both sides ask every kind
        assert any(t.startswith(kind + "/") for t in held) and any(t.startswith(kind + "/") for t in train)
    assert split_templates() == split  # deterministic
    assert any(split_templates(seed) != split for seed in range(5))  # and really seeded
    with pytest.raises(ValueError, match="held_out_per_kind"):
        split_templates(held_out_per_kind=4)  # no train template left


@pytest.mark.parametrize("split", ["train", "held-out"])
def test_prompts_use_only_their_split_s_templates_and_digits(split):
    held = set(split_templates()["held-out"])
    layouts, canvases, prompts = sample_prompts(40, split, seed=3)
    assert all((p.template in held) == (split == "held-out") for p in prompts)
    assert {p.kind for p in prompts} == set(KINDS)
    images, _ = mnist_digits(vlm_prompts.MNIST_SPLIT[split])
    for layout, canvas in zip(layouts[:8], canvases[:8]):  # drawn from the split's own MNIST digits
        assert torch.equal(render(layout, images), canvas)
    train_canvases = sample_prompts(40, "train", seed=3)[1] if split == "held-out" else canvases
    held_canvases = sample_prompts(40, "held-out", seed=3)[1]
    assert not any(torch.equal(a, b) for a in train_canvases for b in held_canvases)


def test_prompts_are_deterministic_given_the_seed():
    a, b, c = (sample_prompts(10, "held-out", seed=s) for s in (7, 7, 8))
    assert a[2] == b[2] and torch.equal(a[1], b[1]) and a[0] == b[0]
    assert not torch.equal(a[1], c[1])


def test_every_prompt_is_answerable_on_its_canvas():
    pattern = re.compile(rf"(\d) at the ({'|'.join(POSITIONS)})")
    layouts, _, prompts = sample_prompts(60, "train", seed=1)
    assert any(layout.count == 1 for layout in layouts)
    kinds = set()
    for layout, prompt in zip(layouts, prompts):
        kinds.add(prompt.kind)
        first = prompt.messages[0]["content"]
        assert first[0] == {"type": "image"} and prompt.messages[-1]["role"] == "user"
        assert prompt.messages[-1]["content"][-1]["text"] == prompt.text
        if prompt.kind == "compare":
            named = pattern.findall(prompt.text)
            assert len(named) == 2 and named[0][1] != named[1][1], prompt.text
            for label, where in named:  # the digit named is the one at that position
                assert layout.cells[POSITIONS.index(where)].label == int(label), (prompt.text, layout)
        else:
            assert layout.count >= 1
        if prompt.kind == "follow-up":
            user = [m for m in prompt.messages if m["role"] == "user"]
            assert len(user) == 2 and {"type": "image"} not in user[1]["content"]
            question = first[1]["text"]
            answer = prompt.messages[1]["content"][0]["text"]
            if question.startswith("Which digit is at the "):  # the first answer is the canvas's truth
                cell = POSITIONS.index(question.removeprefix("Which digit is at the ").rstrip("?"))
                assert answer == make_qa(layout, "which", cell=cell)[1]
            else:
                kind = {"Describe the image.": "describe", "What digits do you see?": "what"}.get(question, "count")
                assert answer == make_qa(layout, kind)[1]
    assert kinds == set(KINDS)
    one = next(layout for layout in layouts if layout.count == 1)
    compare = next(t for t in template_ids("compare"))
    with pytest.raises(ValueError, match="2 digits"):
        make_prompt(one, compare, torch.Generator().manual_seed(0))


def test_unknown_split_template_and_kind_are_named():
    labels = mnist_digits("test")[1]
    layout = sample_layout(labels, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="split"):
        sample_prompts(2, "validation", seed=0)
    with pytest.raises(ValueError, match="num"):
        sample_prompts(0, "train", seed=0)
    with pytest.raises(ValueError, match="story/9"):
        make_prompt(layout, "story/9", torch.Generator())
    with pytest.raises(ValueError, match="kind"):
        template_ids("poem")
