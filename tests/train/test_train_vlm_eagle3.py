"""`python -m mmspec.train vlm-eagle3` (EAGLE-3 head by online distillation, issue 29) on a tiny random LLaVA: a few
steps write a loadable head whose config records the aux layers and the image-input convention, with per-depth loss
and held-out acceptance in the card; `--target-cache` trains the same weights; kill-and-resume is bit-identical; a
changed flag on resume is refused naming it; bad flags are usage errors before anything loads."""

import json

import pytest
import torch
from factories import resumed_after_kill
from test_train_vlm_vision import _tiny_data
from vlm_fixtures import tiny_llava, tiny_processor

from mmspec.train import __main__ as train_main
from mmspec.train import vlm_eagle3 as task


@pytest.fixture(scope="module")
def tiny():
    model, processor = tiny_llava(4, seed=3), tiny_processor()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, processor, _tiny_data(processor)


@pytest.fixture
def files(tmp_path, tiny, monkeypatch):
    model, processor, data = tiny
    target = tmp_path / "target"
    model.config.save_pretrained(target)
    path = tmp_path / "answers.pt"
    torch.save(data, path)
    import mmspec.models.hf.vlm_folder as vlm_folder

    monkeypatch.setattr(vlm_folder, "load_target_vlm", lambda folder, dtype=None: (model, processor))
    return {"target": str(target), "data": str(path)}


def _argv(files, out, *extra):
    return ["vlm-eagle3", "--target", files["target"], "--data", files["data"], "--out", str(out), "--steps", "4",
            "--batch-size", "2", "--checkpoint-every", "2", "--eval-items", "2", "--unroll", "2", "--draft-vocab", "32",
            "--aux-layers", "1,2,3", "--intermediate-size", "48", "--quiet", "--threads", "1", *extra]  # fmt: skip


def _parse(argv):
    import argparse

    parser = argparse.ArgumentParser()
    task.add_arguments(parser)
    return parser.parse_args(argv[1:])


@pytest.mark.parametrize("image_inputs", ["placeholder", "embeds"])
def test_a_few_steps_write_a_loadable_head_with_losses_and_acceptance_by_depth(files, tmp_path, image_inputs):
    from mmspec.models import load
    from mmspec.models.hf.eagle3 import Eagle3Head

    out = tmp_path / "out"
    head = task.run(_parse(_argv(files, out, "--image-inputs", image_inputs, "--storage", "int4")))
    loaded = load(out)
    assert isinstance(loaded, Eagle3Head) and loaded.config.image_inputs == image_inputs
    assert loaded.config.aux_layers == [1, 2, 3] and loaded.config.intermediate_size == 48
    assert torch.equal(loaded.draft_vocab, head.draft_vocab) and loaded.config.draft_vocab_size == 32
    record = json.loads((out / "training.json").read_text())
    metrics = record["metrics"]
    assert {"final_train_loss_step0", "final_train_loss_step1"} <= set(metrics)
    for prefix in ("", "templated_", "free-form_"):
        accept = [metrics[f"{prefix}accept_depth{d}"] for d in range(1, task.EVAL_DEPTH + 1)]
        assert all(0.0 <= a <= 1.0 for a in accept) and accept == sorted(accept, reverse=True), metrics
        assert accept[0] == metrics[f"{prefix}top1_step0"]
    assert record["extra"]["image_inputs"] == image_inputs and record["extra"]["aux_layers"] == [1, 2, 3]
    assert "int4" in record["extra"]["storage"]
    card = (out / "README.md").read_text()
    assert "accept_depth3" in card and "loss_step1" in card and f"image_inputs: {image_inputs}" in card


def test_target_cache_trains_the_same_weights(files, tmp_path):
    plain = task.run(_parse(_argv(files, tmp_path / "plain", "--fp32-weights")))
    cached = task.run(_parse(_argv(files, tmp_path / "cached", "--fp32-weights", "--target-cache")))
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(cached.state_dict()[k], v, atol=1e-3, rtol=1e-3)  # the cache holds float16


def test_kill_and_resume_gives_bit_identical_weights(files, tmp_path, monkeypatch):
    whole = task.run(_parse(_argv(files, tmp_path / "whole", "--fp32-weights")))
    argv = _argv(files, tmp_path / "killed", "--fp32-weights")
    resumed = resumed_after_kill(lambda: task.run(_parse(argv)), monkeypatch)
    for k, v in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k


@pytest.mark.parametrize("flag, value, stored", [("--image-inputs", "embeds", "placeholder"),
                                                 ("--aux-layers", "0,2,3", "1 2 3")])  # fmt: skip
def test_resume_with_a_changed_flag_is_refused_naming_it(files, tmp_path, capsys, flag, value, stored):
    argv = _argv(files, tmp_path / "out")
    train_main.main([*argv[: argv.index("--steps") + 1], "2", *argv[argv.index("--steps") + 2 :]])
    with pytest.raises(SystemExit) as exit_:
        train_main.main([*argv, flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{flag}" in err and "differs from the checkpoint's" in err and stored in err, err


class Ran(Exception):
    pass


@pytest.mark.parametrize(
    "extra, flag",
    [(["--aux-layers", "3,1"], "--aux-layers"), (["--aux-layers", "a"], "--aux-layers"),
     (["--image-inputs", "pixels"], "--image-inputs"), (["--num-attention-heads", "4", "--num-key-value-heads", "3"],
     "--num-key-value-heads"), (["--unroll", "0"], "--unroll")],
)  # fmt: skip
def test_bad_flags_are_usage_errors_before_anything_loads(files, tmp_path, monkeypatch, capsys, extra, flag):
    monkeypatch.setattr(task, "run", lambda args: (_ for _ in ()).throw(Ran()))
    with pytest.raises(SystemExit) as exit_:
        train_main.main(_argv(files, tmp_path / "out", *extra))
    assert exit_.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err.strip().splitlines()[-1]
    with pytest.raises(Ran):
        train_main.main(_argv(files, tmp_path / "out"))


def test_held_out_metrics_score_each_row_on_its_own_tokens(tiny, monkeypatch):
    """`evaluate` runs the target on chunks of `EVAL_CHUNK` held-out rows and scores each row alone: every row's
    features go with that row's own tokens and answer mask, whatever its place in the chunk (the shipped head's card
    once paired row `i` with the tokens of dataset row `i mod EVAL_CHUNK`, its place in the chunk)."""
    from mmspec.models.hf.eagle3 import Eagle3Head
    from mmspec.train.vlm_eagle import answer_mask

    model, processor, data = tiny
    head = Eagle3Head.from_target(model, draft_vocab_size=0, aux_layers=(1, 2, 3), intermediate_size=48).eval()
    ids, lengths = data["input_ids"], data["lengths"]
    weight = answer_mask(lengths, torch.tensor(data["prompt_lengths"]), ids.shape[1])
    held = torch.arange(len(ids) - task.EVAL_CHUNK - 2, len(ids))  # more than one chunk, none at its own index
    assert len(held) > task.EVAL_CHUNK and all(i != r % task.EVAL_CHUNK for r, i in enumerate(held.tolist()))
    seen = []
    scored = task.evaluate_eagle3

    def record(head, target, aux, hidden, tokens, mask, **kw):
        seen.append((tokens, mask, aux.shape[1]))
        return scored(head, target, aux, hidden, tokens, mask, **kw)

    monkeypatch.setattr(task, "evaluate_eagle3", record)
    task.evaluate(head, model, processor, data, held, weight, (1, 2, 3), False)
    assert len(seen) == len(held)
    for i, (tokens, mask, n) in zip(held.tolist(), seen):
        assert n == int(lengths[i])
        assert torch.equal(tokens, ids[i : i + 1, :n]) and torch.equal(mask, weight[i : i + 1, :n]), i
