"""Issue 20, command line: every bad flag of `mmspec generate`, `mmspec bench ar-image | continuous | vlm | verify`
and `python -m mmspec.eval.zoo_eval` is a usage error (exit 2, one line naming the flag) before any model loads;
the `--zoo` default is the shipped zoo from any working directory; `bench vlm --min-digits` cannot loop forever; a
report is written atomically (the plot-after-report order is tested in test_bench_continuous.py)."""

import json
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest

import mmspec.cli as cli
import mmspec.cli.generate as cli_generate
import mmspec.models
import mmspec.pipelines
from mmspec.cli.checks import write_json
from mmspec.eval import bench_ar_image, bench_continuous, bench_verify, bench_vlm, zoo_eval
from mmspec.methods import KNOBS, check_knob


ASSETS = Path(__file__).resolve().parents[2] / "assets"
BIG = str(2**64)  # past torch.Generator.manual_seed's range


def _refuse(*args, **kwargs):
    raise AssertionError("reached model loading / the bench run although the arguments were invalid")


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if a command gets past its argument checks: `generate`, every bench's `run`, the zoo loaders."""
    monkeypatch.setattr(cli_generate, "run", _refuse)
    for module in (bench_ar_image, bench_continuous, bench_verify, bench_vlm):
        monkeypatch.setattr(module, "run", _refuse)
    monkeypatch.setattr(mmspec.models, "load", _refuse)
    for name in ("SpeculativeARImagePipeline", "SpeculativeContinuousARPipeline", "SpeculativeVLMPipeline"):
        monkeypatch.setattr(getattr(mmspec.pipelines, name), "from_zoo", _refuse)


def _zoo(root, folders):
    """A zoo of `folders` with only their config.json (enough for every up-front check; nothing loads)."""
    for name in folders:
        (root / name).mkdir(parents=True)
        if (ASSETS / name / "config.json").is_file():
            shutil.copy(ASSETS / name / "config.json", root / name)
    return str(root)


AR = ["mnist-c2i", "mnist-vq", "mnist-c2i-draft", "mnist-c2i-eagle", "mnist-classifier"]
ZOOS = {  # name -> zoo folders (one thing missing each)
    "ar-no-draft": [f for f in AR if f != "mnist-c2i-draft"],
    "ar-no-drafters": ["mnist-c2i", "mnist-vq", "mnist-classifier"],
    "ar-no-classifier": [f for f in AR if f != "mnist-classifier"],
    "mar-no-draft": ["mnist-mar", "mnist-kl", "mnist-classifier"],
    "vlm-no-eagle": ["mnist-vlm", "mnist-vlm-draft"],
    "vlm-eagle-without-draft-vocab": ["mnist-vlm", "mnist-vlm-draft", "mnist-vlm-eagle"],
}

# (entry point, argv, the flag the one-line error must name); `{zoo:NAME}` is a zoo of ZOOS[NAME], `{tmp}` tmp_path
CASES = [
    # mmspec generate
    ("cli", ["generate", "--seed", BIG], "--seed"),
    ("cli", ["generate", "--batch-size", "100000"], "--batch-size"),
    ("cli", ["generate", "--num-images", "20000"], "--num-images"),
    ("cli", ["generate", "--num-per-class", "20000"], "--num-per-class"),
    ("cli", ["generate", "--threads", "100000"], "--threads"),
    ("cli", ["generate", "--acceptance", "jacobi", "--tree-top-k", "4"], "--tree-top-k"),
    ("cli", ["generate", "--acceptance", "none", "--jacobi-window", "4"], "--jacobi-window"),
    ("cli", ["generate", "--acceptance", "exact", "--drafter", "eagle", "--tree-top-k", "100000"], "--tree-top-k"),
    ("cli", ["generate", "--acceptance", "exact", "--drafter", "eagle", "--tree-depth", "100000"], "--tree-depth"),
    (
        "cli",
        ["generate", "--acceptance", "exact", "--drafter", "model", "--num-draft-tokens", "100000"],
        "--num-draft-tokens",
    ),  # fmt: skip
    ("cli", ["generate", "--jacobi-window", "1000000"], "--jacobi-window"),
    ("cli", ["generate", "--acceptance", "relaxed", "--relaxation-top-k", "100000000"], "--relaxation-top-k"),
    ("cli", ["generate", "--acceptance", "grouped", "--group-size", "100000000"], "--group-size"),
    # mmspec bench ar-image
    ("cli", ["bench", "ar-image", "--device", "warp-drive"], "--device"),
    ("cli", ["bench", "ar-image", "--device", "cuda:99"], "--device"),
    ("cli", ["bench", "ar-image", "--seed", BIG], "--seed"),
    ("cli", ["bench", "ar-image", "--num-images", "1000000000"], "--num-images"),
    ("cli", ["bench", "ar-image", "--batch-size", "100000"], "--batch-size"),
    ("cli", ["bench", "ar-image", "--batch-size", "3", "--num-images", "4"], "--batch-size"),
    ("cli", ["bench", "ar-image", "--batch-size", "8", "--num-images", "4"], "--batch-size"),
    ("cli", ["bench", "ar-image", "--repeats", "1000000000"], "--repeats"),
    ("cli", ["bench", "ar-image", "--threads", "100000"], "--threads"),
    ("cli", ["bench", "ar-image", "--tree-top-k", "100000"], "--tree-top-k"),
    ("cli", ["bench", "ar-image", "--methods", "grouped", "--temperature", "0"], "--temperature"),
    ("cli", ["bench", "ar-image", "--zoo", "{zoo:ar-no-draft}", "--methods", "exact-draft"], "--methods"),
    ("cli", ["bench", "ar-image", "--zoo", "{zoo:ar-no-drafters}"], "--methods"),
    ("cli", ["bench", "ar-image", "--zoo", "{zoo:ar-no-classifier}", "--methods", "plain"], "--zoo"),
    ("cli", ["bench", "ar-image", "--zoo", "{zoo:ar-no-draft}", "--model", "t2i", "--methods", "plain"], "--zoo"),
    ("cli", ["bench", "ar-image", "--json", "{tmp}/no-such-folder/out.json"], "--json"),
    ("cli", ["bench", "ar-image", "--json", "{tmp}"], "--json"),
    ("cli", ["bench", "ar-image", "--json", "{tmp}/out.txt"], "--json"),
    # mmspec bench continuous
    ("cli", ["bench", "continuous", "--json", "{tmp}"], "--json"),
    ("cli", ["bench", "continuous", "--json", "{tmp}/no-such-folder/out.json"], "--json"),
    ("cli", ["bench", "continuous", "--plot", "{tmp}/no-such-folder/p.png"], "--plot"),
    ("cli", ["bench", "continuous", "--plot", "{tmp}/p.txt"], "--plot"),
    ("cli", ["bench", "continuous", "--plot", "{tmp}/p.png", "--num-images", "0"], "--plot"),
    ("cli", ["bench", "continuous", "--num-ar-steps", "65"], "--num-ar-steps"),
    ("cli", ["bench", "continuous", "--fewer-steps", "100"], "--fewer-steps"),
    ("cli", ["bench", "continuous", "--num-draft-tokens", "100"], "--num-draft-tokens"),
    ("cli", ["bench", "continuous", "--prefill-ratio", "1.5"], "--prefill-ratio"),
    ("cli", ["bench", "continuous", "--prefill-ratio", "nan"], "--prefill-ratio"),
    ("cli", ["bench", "continuous", "--guidance-scale", "0.5"], "--guidance-scale"),
    ("cli", ["bench", "continuous", "--guidance-scale", "inf"], "--guidance-scale"),
    ("cli", ["bench", "continuous", "--temperature", "nan"], "--temperature"),
    ("cli", ["bench", "continuous", "--temperature", "0"], "--temperature"),
    ("cli", ["bench", "continuous", "--temperature", "1e400"], "--temperature"),
    ("cli", ["bench", "continuous", "--num-inference-steps", "1"], "--num-inference-steps"),
    ("cli", ["bench", "continuous", "--num-inference-steps", "100000"], "--num-inference-steps"),
    ("cli", ["bench", "continuous", "--batch-size", ","], "--batch-size"),
    ("cli", ["bench", "continuous", "--batch-size", "100000"], "--batch-size"),
    ("cli", ["bench", "continuous", "--num-images", "1"], "--num-images"),
    ("cli", ["bench", "continuous", "--num-images", "1000000000"], "--num-images"),
    ("cli", ["bench", "continuous", "--quality-batch-size", "1000000"], "--quality-batch-size"),
    ("cli", ["bench", "continuous", "--timing-batches", "1000000000"], "--timing-batches"),
    ("cli", ["bench", "continuous", "--skip-quality", "warp-drive"], "--skip-quality"),
    ("cli", ["bench", "continuous", "--device", "warp-drive"], "--device"),
    ("cli", ["bench", "continuous", "--seed", BIG], "--seed"),
    ("cli", ["bench", "continuous", "--threads", "100000"], "--threads"),
    ("cli", ["bench", "continuous", "--zoo", "{zoo:mar-no-draft}"], "--verify-modes"),
    ("cli", ["bench", "continuous", "--zoo", "{tmp}/no-such-zoo"], "--zoo"),
    # mmspec bench vlm
    ("cli", ["bench", "vlm", "--min-digits", "9"], "--min-digits"),
    ("cli", ["bench", "vlm", "--max-new-tokens", "1000000"], "--max-new-tokens"),
    ("cli", ["bench", "vlm", "--max-new-tokens", "8190"], "--max-new-tokens"),  # past the model's 8192 context
    ("cli", ["bench", "vlm", "--tree-top-k", "100000"], "--tree-top-k"),
    ("cli", ["bench", "vlm", "--tree-depth", "1000"], "--tree-depth"),
    ("cli", ["bench", "vlm", "--tree-nodes", "100000"], "--tree-nodes"),
    ("cli", ["bench", "vlm", "--model-tree-top-k", "1000"], "--model-tree-top-k"),
    ("cli", ["bench", "vlm", "--model-tree-depth", "1000"], "--model-tree-depth"),
    ("cli", ["bench", "vlm", "--model-tree-nodes", "100000"], "--model-tree-nodes"),
    ("cli", ["bench", "vlm", "--num-draft-tokens", "100000"], "--num-draft-tokens"),
    ("cli", ["bench", "vlm", "--confident-draft-tokens", "100000"], "--confident-draft-tokens"),
    ("cli", ["bench", "vlm", "--draft-confidence", "1"], "--draft-confidence"),
    ("cli", ["bench", "vlm", "--draft-confidence", "0"], "--draft-confidence"),
    ("cli", ["bench", "vlm", "--batch-size", "16", "--num-prompts", "8"], "--batch-size"),
    ("cli", ["bench", "vlm", "--batch-size", ","], "--batch-size"),
    ("cli", ["bench", "vlm", "--num-prompts", "1000000000"], "--num-prompts"),
    ("cli", ["bench", "vlm", "--zoo", "{zoo:vlm-no-eagle}", "--methods", "plain,eagle"], "--methods"),
    (
        "cli",
        ["bench", "vlm", "--zoo", "{zoo:vlm-eagle-without-draft-vocab}", "--methods", "draft-model-frspec"],
        "--methods",
    ),  # fmt: skip
    ("cli", ["bench", "vlm", "--zoo", "{tmp}/no-such-zoo"], "--zoo"),
    ("cli", ["bench", "vlm", "--prompt", "  "], "--prompt"),
    ("cli", ["bench", "vlm", "--device", "warp-drive"], "--device"),
    ("cli", ["bench", "vlm", "--seed", BIG], "--seed"),
    ("cli", ["bench", "vlm", "--threads", "100000"], "--threads"),
    ("cli", ["bench", "vlm", "--json", "{tmp}"], "--json"),
    ("cli", ["bench", "vlm", "--packed-linear", "--device", "cuda"], "--packed-linear"),
    # mmspec bench verify
    ("cli", ["bench", "verify", "--neighbours", "20000"], "--neighbours"),
    ("cli", ["bench", "verify", "--vocab", "0"], "--vocab"),
    ("cli", ["bench", "verify", "--num-draft", "0"], "--num-draft"),
    ("cli", ["bench", "verify", "--batch-sizes", "0"], "--batch-sizes"),
    ("cli", ["bench", "verify", "--batch-sizes", "1024", "--vocab", "1000000"], "--batch-sizes"),
    ("cli", ["bench", "verify", "--rules", "warp-drive"], "--rules"),
    ("cli", ["bench", "verify", "--repeats", "0"], "--repeats"),
    ("cli", ["bench", "verify", "--warmup", "-1"], "--warmup"),
    ("cli", ["bench", "verify", "--codebook-dim", "0"], "--codebook-dim"),
    ("cli", ["bench", "verify", "--value-dim", "0"], "--value-dim"),
    ("cli", ["bench", "verify", "--threads", "0"], "--threads"),
    ("cli", ["bench", "verify", "--seed", "-1"], "--seed"),
    ("cli", ["bench", "verify", "--device", "warp-drive"], "--device"),
    ("cli", ["bench", "verify", "--json", "{tmp}/out.txt"], "--json"),
    # python -m mmspec.eval.zoo_eval
    ("zoo_eval", ["--per-class", "0"], "--per-class"),
    ("zoo_eval", ["--per-class", "1000000000"], "--per-class"),
    ("zoo_eval", ["--guidance-scale", "nan"], "--guidance-scale"),
    ("zoo_eval", ["--temperature", "-1"], "--temperature"),
    ("zoo_eval", ["--acceptance", "grouped", "--temperature", "0"], "--temperature"),
    ("zoo_eval", ["--seed", "-1"], "--seed"),
    ("zoo_eval", ["--batch-size", "0"], "--batch-size"),
    ("zoo_eval", ["--device", "warp-drive"], "--device"),
    ("zoo_eval", ["--prefix", "warp-drive"], "--zoo"),
    ("zoo_eval", ["--zoo", "{tmp}/no-such-zoo"], "--zoo"),
    ("zoo_eval", ["--zoo", "{zoo:ar-no-classifier}", "--no-write"], "--zoo"),
]


@pytest.mark.parametrize("name", [n for n, k in KNOBS.items() if k.kind is int])
def test_every_int_knob_has_an_upper_bound(name):
    """A typo like 100000 (tree_top_k: 21 GB) is refused by the registry, so by every pipeline and every flag."""
    with pytest.raises(ValueError, match=name):
        check_knob(name, 10**6)


def _fill(argv, tmp_path):
    out = []
    for arg in argv:
        if arg.startswith("{zoo:"):
            name = arg[5:-1]
            arg = _zoo(tmp_path / name, ZOOS[name])
            if name == "vlm-eagle-without-draft-vocab":
                config = Path(arg) / "mnist-vlm-eagle" / "config.json"
                config.write_text(json.dumps(json.loads(config.read_text()) | {"draft_vocab_size": 0}))
        out.append(arg.replace("{tmp}", str(tmp_path)))
    return out


@pytest.mark.parametrize("entry, argv, flag", CASES, ids=[" ".join(c[1]) for c in CASES])
def test_bad_flag_is_a_usage_error_before_loading(entry, argv, flag, tmp_path, capsys, no_loading):
    main = cli.main if entry == "cli" else zoo_eval.main
    with pytest.raises(SystemExit) as exit_info:
        main(_fill(argv, tmp_path))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    last = err.strip().splitlines()[-1]
    assert "error:" in last and flag in last, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "entry, argv",
    [
        ("cli", ["bench", "continuous", "--num-images", "0", "--timing-batches", "1"]),
        ("cli", ["bench", "vlm", "--num-prompts", "1"]),
        ("zoo_eval", ["--no-write", "--per-class", "1"]),
    ],
)
def test_default_zoo_is_the_shipped_zoo_from_any_directory(entry, argv, tmp_path, monkeypatch):
    """Run from a folder without `assets/`: the checks pass on the shipped zoo and the run gets its absolute path."""
    seen = []

    class Reached(Exception):
        pass

    def record(args_or_root=None, *rest, **kwargs):
        seen.append(getattr(args_or_root, "zoo", args_or_root))
        raise Reached

    for module in (bench_continuous, bench_vlm):
        monkeypatch.setattr(module, "run", record)
    monkeypatch.setattr(mmspec.pipelines.SpeculativeARImagePipeline, "from_zoo", record)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Reached):
        (cli.main if entry == "cli" else zoo_eval.main)(argv)
    assert Path(seen[0]).is_absolute() and Path(seen[0]) == ASSETS


@contextmanager
def _deadline(seconds):
    def expire(*args):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_held_out_canvases_refuses_more_digits_than_a_canvas_holds(monkeypatch):
    """`min_digits` 5+ can never be met (4 cells): a ValueError naming it, not an endless loop."""
    import torch

    import mmspec.data.canvases as vlm_data

    monkeypatch.setattr(vlm_data, "mnist_digits", lambda split: (torch.zeros(10, 28, 28), torch.arange(10)))
    with _deadline(20), pytest.raises(ValueError, match="min_digits"):
        vlm_data.held_out_canvases(2, seed=0, min_digits=9)


def test_write_json_never_leaves_a_partial_report(tmp_path, monkeypatch):
    """An interrupted write keeps the previous report whole and leaves no temporary file behind."""
    import os

    path = tmp_path / "report.json"
    write_json(path, {"run": 1})
    assert json.loads(path.read_text()) == {"run": 1}

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        write_json(path, {"run": 2})
    assert json.loads(path.read_text()) == {"run": 1} and sorted(tmp_path.iterdir()) == [path]
