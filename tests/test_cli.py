"""`mmspec` command line: commands and bench subcommands register from tables, method options come from the
registry (`mmspec.methods`), bad options are usage errors (exit 2) before anything is loaded, and generators are
made on the device the pipeline runs on."""

import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

import mmspec.cli as cli
from mmspec.eval import bench, bench_ar_image, zoo_eval
from mmspec.methods import ACCEPTANCES, DRAFTERS, KNOBS, Acceptance


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

    monkeypatch.setattr(cli, "generate", refuse)
    _fake_pipelines(monkeypatch, refuse)


@pytest.fixture
def parsed(monkeypatch):
    """`mmspec generate` parses its arguments but does not run: returns the list of parsed namespaces."""
    calls = []
    monkeypatch.setattr(cli, "generate", calls.append)
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
        (["generate", "--tree-depth", "0"], "tree_depth must be >= 1"),
        (["generate", "--jacobi-window", "2.5"], "--jacobi-window"),
        (["generate", "--relaxation-delta", "nan"], "relaxation_delta"),
        (["generate", "--resample", "foo"], "--resample: invalid choice"),
        (["warp-drive"], "invalid choice: 'warp-drive'"),
        ([], "COMMAND"),
        (["bench", "warp-drive"], "invalid choice: 'warp-drive'"),
        (["bench", "ar-image", "--jacobi-window", "-1"], "jacobi_window must be >= 1"),
        (["bench", "ar-image", "--tree-top-k", "x"], "--tree-top-k"),
    ],
)
def test_bad_options_are_usage_errors_before_loading(argv, match, capsys, no_loading):
    _usage_error(argv, capsys, match)


def test_generate_choices_and_knob_flags_come_from_the_registry(parsed, monkeypatch):
    for acceptance in ACCEPTANCES:
        cli.main(["generate", "--acceptance", acceptance])
    for drafter in DRAFTERS:
        cli.main(["generate", "--drafter", drafter])
    assert [a.acceptance for a in parsed[: len(ACCEPTANCES)]] == list(ACCEPTANCES)
    monkeypatch.setitem(ACCEPTANCES, "new-rule", Acceptance("new-rule", "a rule added later", True, ("model",)))
    cli.main(["generate", "--acceptance", "new-rule", "--tree-depth", "3", "--no-coupling", "--resample", "released"])
    args = parsed[-1]
    assert args.acceptance == "new-rule"
    assert cli.knob_values(args) == {"tree_depth": 3, "coupling": False, "resample": "released"}
    cli.main(["generate"])
    assert cli.knob_values(parsed[-1]) == {} and parsed[-1].acceptance == "jacobi"  # unset: pipeline defaults


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
    assert set(cli.COMMANDS) == {"generate", "bench", "train", "eval"}
    for entry, help_text in cli.COMMANDS.values():
        assert callable(cli._entry_point(entry)) and help_text
    assert cli._entry_point(cli.COMMANDS["bench"][0]) is bench.main
    import mmspec.eval as evaluation

    assert cli._entry_point(cli.COMMANDS["eval"][0]) is evaluation.main and "fid" in evaluation.COMMANDS
    assert {"ar-image", "verify"} <= set(bench.SUBCOMMANDS)
    for spec, help_text in bench.SUBCOMMANDS.values():
        sub = bench._subcommand(spec)
        assert callable(sub.add_arguments) and callable(sub.run) and help_text
    assert bench._subcommand(bench.SUBCOMMANDS["ar-image"][0]) is bench_ar_image


def test_generate_dispatches_through_the_table(monkeypatch):
    seen = []
    monkeypatch.setitem(cli.COMMANDS, "echo", ("tests_cli_echo:main", "test command"))
    monkeypatch.setattr(cli, "_entry_point", lambda spec: lambda argv: seen.append((spec, argv)))
    assert cli.main(["echo", "a", "--b"]) == 0
    assert seen == [("tests_cli_echo:main", ["a", "--b"])]


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
