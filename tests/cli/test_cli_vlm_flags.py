"""`mmspec vlm`: every bad flag is a one-line usage error (exit 2, naming the flag) before any model loads."""

import shutil

import pytest

from mmspec import cli
from mmspec.cli import vlm as cli_vlm
from mmspec.cli.args import DEFAULT_ZOO


@pytest.fixture
def files(tmp_path):
    (tmp_path / "not-an-image.png").write_text("hello")
    (tmp_path / "empty.png").write_bytes(b"")
    zoo = tmp_path / "zoo-without-eagle"
    zoo.mkdir()
    shutil.copytree(f"{DEFAULT_ZOO}/mnist-vlm", zoo / "mnist-vlm")
    return tmp_path


CASES = [
    (["--tree-top-k", "100000"], "--tree-top-k"),
    (["--tree-top-k", "33"], "--tree-top-k"),
    (["--tree-depth", "33"], "--tree-depth"),
    (["--num-draft-tokens", "257"], "--num-draft-tokens"),
    (["--max-new-tokens", "40000"], "--max-new-tokens"),
    (["--max-new-tokens", "8192"], "--max-new-tokens"),  # the zoo's context (prompt included)
    (["--top-k", "50000", "--do-sample"], "--top-k"),
    (["--prompt", "  "], "--prompt"),
    (["--image", "{tmp}/not-an-image.png"], "--image"),
    (["--image", "{tmp}/empty.png"], "--image"),
    (["--save-image", "{tmp}/no/such/folder/canvas.png"], "--save-image"),
    (["--save-image", "{tmp}/canvas.json"], "--save-image"),
    (["--save-image", "{tmp}"], "--save-image"),
    (["--device", "cuda:7"], "--device"),
    (["--device", "tpu"], "--device"),
    (["--acceptance", "greedy", "--do-sample"], "--do-sample"),
    (["--acceptance", "none", "--tree-depth", "3"], "--tree-depth"),
    (["--acceptance", "none", "--tree-top-k", "4"], "--tree-top-k"),
    (["--zoo", "{tmp}/zoo-without-eagle"], "--drafter"),
    (["--zoo", "{tmp}/zoo-without-eagle", "--drafter", "model"], "--drafter"),
    (["--threads", "100000"], "--threads"),
    (["--draft-length", "longest"], "--draft-length"),
    (["--draft-length", "heuristic", "--tree-top-k", "4"], "--draft-length"),  # a tree has no chain length
    (["--acceptance", "none", "--draft-length", "cost"], "--draft-length"),
    (["--draft-confidence", "1.5"], "--draft-confidence"),
    (["--draft-length", "cost", "--draft-step-cost", "-1"], "--draft-step-cost"),
    (["--draft-length", "cost", "--verify-token-cost", "nan"], "--verify-token-cost"),
    (["--draft-length", "heuristic", "--verify-token-cost", "0.2"], "--verify-token-cost"),  # not the cost policy
]


@pytest.mark.parametrize("argv,flag", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_flags_are_usage_errors_before_any_model_loads(argv, flag, files, capsys, monkeypatch):
    monkeypatch.setattr(cli_vlm, "run", lambda args: pytest.fail("a model was loaded"))
    monkeypatch.setattr("mmspec.pipelines.vlm.SpeculativeVLMPipeline.from_zoo", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(SystemExit) as exc:
        cli.main(["vlm", *[a.replace("{tmp}", str(files)) for a in argv]])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and flag in err.strip().splitlines()[-1]
