"""Reliability of the training tasks (issue 20): a resume with flags that change the result is refused (or, for a
raised --steps, recorded), bad flags are usage errors before any model or data loads, input defaults resolve to the
shipped zoo from any working directory, broken checkpoints name their file, and canvases asking for more digits than a
canvas holds fail at once."""

import argparse
import json
from pathlib import Path

import pytest
import torch

from mmspec.cli.args import DEFAULT_ZOO
from mmspec.train import __main__ as train_main
from mmspec.train.common import (
    CHECKPOINT_NAME,
    add_common_arguments,
    save_checkpoint,
    seed_everything,
    train_with_args,
    write_model_card,
)


# ----------------------------------------------------------------------------- resume with changed flags


def _parse(out, *argv, data=None):
    parser = argparse.ArgumentParser()
    add_common_arguments(parser, steps=4, batch_size=4, lr=1e-2, warmup_steps=1, checkpoint_every=2)
    parser.add_argument("--hidden", type=int, default=8)
    parser.add_argument("--data", default=None)  # an input: recorded by its sha256
    extra = ["--data", str(data)] if data is not None else []
    return parser.parse_args(["--out", str(out), "--quiet", "--log-every", "2", *extra, *argv])


def _train(args):
    """A tiny regression run whose every flag matters (batch size, lr, seed, width, the --data file's numbers)."""
    generator = seed_everything(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, args.hidden), torch.nn.Tanh(), torch.nn.Linear(args.hidden, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    shift = float(Path(args.data).read_text()) if args.data else 0.0

    def step_fn(step):
        x = torch.randn(args.batch_size, 3, generator=generator)
        return {"loss": (model(x) - x.sum(-1, keepdim=True) - shift).pow(2).mean()}

    return train_with_args(model, optimizer, step_fn, args, generator), model


@pytest.mark.parametrize(
    "flag, value, stored",
    [("--lr", "0.05", "0.01"), ("--batch-size", "8", "4"), ("--seed", "3", "0"), ("--weight-decay", "0.1", "0.0"),
     ("--warmup-steps", "2", "1"), ("--grad-clip", "0.5", "1.0"), ("--hidden", "16", "8")],
)  # fmt: skip
def test_resume_with_a_changed_flag_is_refused_naming_it(tmp_path, flag, value, stored):
    _train(_parse(tmp_path, "--steps", "2"))  # checkpoint at step 2 of 2 ...
    with pytest.raises(ValueError) as err:  # ... resumed to 4 steps with one flag changed
        _train(_parse(tmp_path, "--steps", "4", flag, value))
    message = str(err.value)
    assert f"{flag} {value} differs from the checkpoint's {flag} {stored}" in message
    assert f"resume with {flag} {stored}" in message and "another --out" in message
    assert str(tmp_path / CHECKPOINT_NAME) in message
    # flags that do not change the result may change: the run continues from its checkpoint
    result, _ = _train(_parse(tmp_path, "--steps", "4", "--threads", "2", "--checkpoint-every", "1", "--note", "x"))
    assert result.resumed_from == 2 and result.step == 4


def test_resume_with_another_input_is_refused_but_a_moved_copy_is_accepted(tmp_path):
    data = tmp_path / "shift.txt"
    data.write_text("0.5")
    _train(_parse(tmp_path / "run", "--steps", "2", data=data))
    moved = tmp_path / "elsewhere.txt"
    moved.write_text("0.5")
    data.write_text("1.5")  # the same path now holds other numbers
    with pytest.raises(ValueError, match=r"the input of --data .*shift\.txt.* is not the one the checkpoint"):
        _train(_parse(tmp_path / "run", "--steps", "4", data=data))
    result, _ = _train(_parse(tmp_path / "run", "--steps", "4", data=moved))  # same content: resumes
    assert result.resumed_from == 2


def test_steps_below_the_checkpoint_are_refused_and_raised_steps_are_recorded(tmp_path):
    _train(_parse(tmp_path, "--steps", "4"))
    with pytest.raises(ValueError, match=r"--steps 2 is below the checkpoint's step 4 \(of 4\): pass --steps 4"):
        _train(_parse(tmp_path, "--steps", "2"))
    args = _parse(tmp_path, "--steps", "6")
    result, model = _train(args)
    assert result.resumed_from == 4 and result.step == 6
    assert result.segments == [{"from_step": 0, "total_steps": 4}, {"from_step": 4, "total_steps": 6}]
    record = write_model_card(tmp_path, title="t", model=model, data="d", wall_time_s=1.0, metrics={}, args=args)
    schedule = record["extra"]["steps_schedule"]
    assert "steps 0-4 under --steps 4" in schedule and "steps 4-6 under --steps 6" in schedule
    assert "steps_schedule" in (tmp_path / "README.md").read_text()


def test_a_checkpoint_that_is_not_a_training_checkpoint_names_its_file(tmp_path):
    path = tmp_path / CHECKPOINT_NAME  # (a truncated one already named it: `load_checkpoint`)
    save_checkpoint(path, torch.zeros(3))
    with pytest.raises(ValueError, match=str(path)):
        _train(_parse(tmp_path, "--steps", "2"))


# ----------------------------------------------------------------------------- train flags refused at parse time


class Ran(Exception):
    """Raised by the patched task `run`: the command got past its usage checks."""


@pytest.fixture
def no_run(monkeypatch):
    """Patch every task's `run` so that reaching it raises `Ran` (nothing loads)."""
    import importlib

    for module_name, _ in train_main.TASKS.values():
        module = importlib.import_module(module_name)

        def run(args):
            raise Ran(args)

        monkeypatch.setattr(module, "run", run)


@pytest.fixture
def paths(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    file = tmp_path / "file.pt"
    file.write_bytes(b"x")
    return {"FILE": str(file), "DIR": str(folder), "MISSING": str(tmp_path / "missing"),
            "UNDER_FILE": str(file / "sub"), "OUT": str(tmp_path / "out"), "OUTPT": str(tmp_path / "out.pt")}  # fmt: skip


COMMON = [  # (argv, flag) for every task built on add_common_arguments (NaN / 0 / negative were refused before)
    (["--lr", "1e30"], "--lr"), (["--steps", "1000000000000"], "--steps"),
    (["--batch-size", "1000000000"], "--batch-size"), (["--weight-decay", "1e6"], "--weight-decay"),
    (["--threads", "100000"], "--threads"), (["--out", "FILE"], "--out"), (["--out", "UNDER_FILE"], "--out"),
]  # fmt: skip
C2I_DATA = ["--data", "FILE"]  # an existing (dummy) codes file, so that the trial's own flag is the one refused
TRIALS = {
    "vq": [(["--data", "bogus"], "--data"), (["--eval-split", "train+nope"], "--eval-split")],
    "classifier": [(["--data", "nope"], "--data")],
    "kl": [(["--classifier", "MISSING"], "--classifier"), (["--classifier", "FILE"], "--classifier"),
           (["--data", "x"], "--data"), (["--eval-split", ""], "--eval-split")],
    "c2i": [(["--data", "MISSING"], "--data"), (["--data", "DIR"], "--data"),
            (C2I_DATA + ["--dim", "100", "--n-head", "8"], "--n-head")],
    "draft": [(["--target", "MISSING"], "--target"), (["--target", "DIR"], "--target"),
              (C2I_DATA + ["--dim", "100", "--n-head", "3"], "--n-head")],
    "eagle": [(["--target", "MISSING"], "--target"), (C2I_DATA + ["--init", "MISSING"], "--init")],
    "mar": [(["--kl", "MISSING"], "--kl"), (["--cache", "DIR"], "--cache"), (["--dim", "30", "--heads", "4"], "--heads")],
    "vlm": [(["--work", "FILE"], "--work"), (["--hidden", "100", "--heads", "6"], "--heads")],
    "t2i": [(C2I_DATA + ["--init-from", "MISSING"], "--init-from"), (C2I_DATA + ["--vq", "DIR"], "--vq"),
            (C2I_DATA + ["--classifier", "MISSING"], "--classifier"), (C2I_DATA + ["--captions", "DIR"], "--captions"),
            (C2I_DATA + ["--dim", "64", "--n-head", "5"], "--n-head")],
    "tokenize": [(["--vq", "MISSING"], "--vq"), (["--out", "DIR"], "--out"), (["--splits", "train+x"], "--splits"),
                 (["--seed", "-1"], "--seed"), (["--steps", "-1"], "--steps")],
    "vlm-answers": [(["--target", "MISSING"], "--target"), (["--out", "DIR"], "--out"),
                    (["--out", "UNDER_FILE"], "--out"), (["--num", "10000000000"], "--num"),
                    (["--max-new-tokens", "1000000000"], "--max-new-tokens"), (["--batch-size", "100000000"], "--batch-size"),
                    (["--threads", "100000"], "--threads")],
    "vlm-draft": [(["--target", "MISSING"], "--target"), (["--data", "MISSING"], "--data"),
                  (["--data", "FILE", "--num-layers", "31"], "--num-layers"),
                  (["--data", "FILE", "--num-layers", "4", "--train-layers", "5"], "--train-layers")],
    "vlm-eagle": [(["--target", "DIR"], "--target"), (["--data", "DIR"], "--data"),
                  (["--data", "FILE", "--draft-vocab", "-1"], "--draft-vocab")],
}  # fmt: skip
HUGE = "1000000000"  # a size typo: refused before it costs all the memory
for task, flag in [("vq", "--codebook-size"), ("vq", "--ch"), ("classifier", "--feature-dim"), ("kl", "--ch"),
                   ("kl", "--eval-images"), ("c2i", "--dim"), ("c2i", "--eval-size"), ("draft", "--n-layer"),
                   ("eagle", "--unroll"), ("mar", "--eval-samples"), ("mar", "--buffer-size"), ("vlm", "--hidden"),
                   ("vlm", "--stage1-batch-size"), ("t2i", "--sample-size"), ("tokenize", "--batch-size"),
                   ("vlm-draft", "--eval-items"), ("vlm-eagle", "--ce-positions")]:  # fmt: skip
    TRIALS[task].append(((C2I_DATA if task in ("c2i", "draft", "eagle", "t2i", "vlm-draft", "vlm-eagle") else [])
                         + [flag, HUGE], flag))  # fmt: skip
COMMON_TASKS = ["vq", "classifier", "kl", "c2i", "draft", "eagle", "mar", "vlm", "t2i", "vlm-draft", "vlm-eagle"]
CASES = [(task, argv, flag) for task, trials in TRIALS.items() for argv, flag in trials]
CASES += [(task, C2I_DATA + argv if task in ("c2i", "draft", "eagle", "t2i", "vlm-draft", "vlm-eagle") else argv, flag)
          for task in COMMON_TASKS for argv, flag in COMMON]  # fmt: skip


def _argv(task, argv, paths):
    argv = [paths.get(a, a) for a in argv]
    if "--out" not in argv:
        argv += ["--out", paths["OUTPT"] if task in ("vlm-answers", "tokenize") else paths["OUT"]]
    if task == "vlm" and "--work" not in argv:
        argv += ["--work", paths["OUT"] + "-work"]
    return [task, *argv]


@pytest.mark.parametrize("task, argv, flag", CASES, ids=[f"{t}:{' '.join(a)}" for t, a, _ in CASES])
def test_bad_train_flag_is_a_usage_error_before_anything_loads(no_run, paths, capsys, task, argv, flag):
    with pytest.raises(SystemExit) as exit_:
        train_main.main(_argv(task, argv, paths))
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and f"argument {flag}:" in err[-1], err


@pytest.mark.parametrize(
    "task, flag, folder",
    [("draft", "target", "mnist-c2i"), ("eagle", "target", "mnist-c2i"), ("kl", "classifier", "mnist-classifier"),
     ("mar", "kl", "mnist-kl"), ("t2i", "classifier", "mnist-classifier"), ("tokenize", "vq", "mnist-vq"),
     ("vlm-answers", "target", "mnist-vlm"), ("vlm-draft", "target", "mnist-vlm"), ("vlm-eagle", "target", "mnist-vlm")],
)  # fmt: skip
def test_input_models_default_to_the_shipped_zoo_from_any_folder(no_run, paths, monkeypatch, tmp_path, task, flag,
                                                                  folder):  # fmt: skip
    monkeypatch.chdir(tmp_path)  # no ./assets here
    argv = C2I_DATA if task in ("draft", "eagle", "t2i", "vlm-draft", "vlm-eagle") else []
    with pytest.raises(Ran) as ran:
        train_main.main(_argv(task, argv, paths))
    value = getattr(ran.value.args[0], flag)
    assert Path(value) == Path(DEFAULT_ZOO) / folder and (Path(value) / "config.json").is_file()


# ----------------------------------------------------------------------------- canvases


def test_sample_layout_refuses_more_digits_than_a_canvas_holds():
    from mmspec.data.canvases import sample_layout

    labels, gen = torch.arange(10), torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="min_digits=9"):
        sample_layout(labels, gen, min_digits=9)  # used to loop forever (bench vlm --min-digits 9)
    with pytest.raises(ValueError, match="min_digits=3"):
        sample_layout(labels, gen, max_digits=2, min_digits=3)
    with pytest.raises(ValueError, match="max_digits=9"):
        sample_layout(labels, gen, max_digits=9)  # used to give canvases with fewer digits than asked
    with pytest.raises(ValueError, match="count_weights"):  # no odds for 3-4 digits: it would never finish
        sample_layout(labels, gen, count_weights=torch.tensor([1.0, 1.0, 0.0, 0.0]), min_digits=3)


def test_sample_layout_min_digits_is_the_same_stream_as_rejecting_by_hand():
    from mmspec.data.canvases import sample_layout

    labels = torch.arange(10)
    gen = torch.Generator().manual_seed(5)
    by_hand = []
    while len(by_hand) < 6:
        layout = sample_layout(labels, gen)
        if layout.count >= 3:
            by_hand.append(layout)
    gen = torch.Generator().manual_seed(5)
    assert [sample_layout(labels, gen, min_digits=3) for _ in range(6)] == by_hand


# ----------------------------------------------------------------------------- vlm-answers


def _answers_args(out, *argv):
    from mmspec.train import vlm_answers

    parser = argparse.ArgumentParser()
    vlm_answers.add_arguments(parser)
    return parser.parse_args(["--out", str(out), "--num", "2", "--batch-size", "2", "--max-new-tokens", "3",
                              "--threads", "1", "--quiet", *argv])  # fmt: skip


def test_vlm_answers_resume_refuses_another_seed_and_names_a_broken_file(tmp_path):
    from mmspec.train import vlm_answers

    out = tmp_path / "answers.pt"
    record = vlm_answers.run(_answers_args(out, "--seed", "1"))
    assert len(record["rows"]) == 2 and record["run_flags"]["seed"] == 1
    for flag, value, stored in (("--seed", "2", "1"), ("--num", "3", "2"), ("--max-new-tokens", "4", "3")):
        argv = ["--seed", "1", flag, value]  # the later flag wins
        with pytest.raises(ValueError, match=f"{flag} {value} differs from the checkpoint's {flag} {stored}"):
            vlm_answers.run(_answers_args(out, *argv))
    again = vlm_answers.run(_answers_args(out, "--seed", "1"))  # the same command: nothing to add, same rows
    assert again["rows"] == record["rows"] and torch.equal(again["canvases"], record["canvases"])

    out.write_bytes(out.read_bytes()[:200])
    with pytest.raises(ValueError, match=str(out)):
        vlm_answers.run(_answers_args(out, "--seed", "1"))


def test_training_record_json_is_untouched_by_a_plain_resume(tmp_path):
    """A resume with the same flags records one schedule segment and no steps_schedule (the shipped recipes)."""
    args = _parse(tmp_path, "--steps", "2")
    _train(args)
    args = _parse(tmp_path, "--steps", "2")
    result, model = _train(args)
    assert result.segments == [{"from_step": 0, "total_steps": 2}]
    write_model_card(tmp_path, title="t", model=model, data="d", wall_time_s=1.0, metrics={}, args=args)
    assert "steps_schedule" not in json.loads((tmp_path / "training.json").read_text())["extra"]


def _fake_checkpoint(path, task, argv, step, total_steps):
    """A checkpoint as `train_loop` writes it for `task` parsed from `argv` (weights do not matter here)."""
    import importlib

    from mmspec.train.common import run_flags

    parser = argparse.ArgumentParser()
    importlib.import_module(train_main.TASKS[task][0]).add_arguments(parser)
    flags = run_flags(parser.parse_args(argv))
    save_checkpoint(path, {"model": {}, "optimizer": {}, "step": step, "total_steps": total_steps, "rng": {},
                           "wall_time_s": 0.0, "history": [], "window": {}, "run_flags": flags})  # fmt: skip


@pytest.mark.parametrize(
    "task, checkpoint, argv, message",
    [("c2i", "checkpoint.pt", ["--lr", "0.5"], "--lr 0.5 differs from the checkpoint's --lr 0.001"),
     ("c2i", "checkpoint.pt", ["--steps", "2"], "--steps 2 is below the checkpoint's step 3"),
     ("c2i", "checkpoint.pt", ["--seed", "7"], "--seed 7 differs from the checkpoint's --seed 0"),
     ("vq", "checkpoint.pt", ["--data", "train+val"], "--data train+val differs from the checkpoint's --data train"),
     ("vlm", "work/stage1/checkpoint.pt", ["--stage1-steps", "1"], "--stage1-steps 1 is below the checkpoint's"),
     ("vlm", "work/stage2/checkpoint.pt", ["--digit-weight", "2"], "--digit-weight 2.0 differs"),
     ("vlm-answers", "out.pt", ["--seed", "5"], "--seed 5 differs from the checkpoint's --seed 1234")],
)  # fmt: skip
def test_resume_with_changed_flags_is_refused_before_anything_loads(no_run, paths, capsys, tmp_path, task,
                                                                     checkpoint, argv, message):  # fmt: skip
    out = tmp_path / ("out.pt" if task == "vlm-answers" else "out")
    base = [task, "--out", str(out), "--quiet"] + (["--data", paths["FILE"]] if task == "c2i" else [])
    base += ["--work", str(tmp_path / "work")] if task == "vlm" else []
    if task == "vlm-answers":
        from mmspec.train.vlm_answers import add_arguments, answers_flags, resolve_defaults

        parser = argparse.ArgumentParser()
        add_arguments(parser)
        flags = answers_flags(resolve_defaults(parser.parse_args(base[1:])))  # as `run` records them
        save_checkpoint(out, {"rows": [[1]], "prompt_lengths": [1], "run_flags": flags})
    else:
        _fake_checkpoint(tmp_path / checkpoint if task == "vlm" else out / checkpoint, task, base[1:], 3, 4)
    with pytest.raises(Ran):  # the same flags (and cosmetic changes) go through
        train_main.main([*base, "--threads", "3"])
    with pytest.raises(SystemExit) as exit_:
        train_main.main([*base, *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "cannot resume" in err[-1], err


def test_a_truncated_latent_cache_names_its_file(tmp_path):
    import hashlib

    from mmspec.train.mar import encode_dataset

    kl = Path(DEFAULT_ZOO) / "mnist-kl"
    digest = hashlib.sha256(next(kl.glob("*.safetensors")).read_bytes()).hexdigest()[:16]
    cache = tmp_path / f"latents-train-{digest}.pt"
    save_checkpoint(cache, {"mean": torch.zeros(4, 3)})
    cache.write_bytes(cache.read_bytes()[:100])  # killed while copying
    with pytest.raises(ValueError, match=str(cache)):
        encode_dataset(kl, tmp_path / "latents.pt")
