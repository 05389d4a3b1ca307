"""`mmspec vlm`: usage errors before any model loads, and one real answer from the shipped zoo (= plain decoding)."""

import json

import pytest

from mmspec import cli
from mmspec.cli import vlm as cli_vlm


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--image", "no/such.png"], "--image"),
        (["--zoo", "no/such/zoo"], "--zoo"),
        (["--drafter", "jacobi"], "--drafter"),
        (["--top-p", "1.5"], "--top-p"),
        (["--acceptance", "none", "--num-draft-tokens", "3"], "--num-draft-tokens"),
    ],
)
def test_usage_errors_name_the_argument(argv, needle, capsys, monkeypatch):
    monkeypatch.setattr(cli_vlm, "run", lambda args: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as exc:
        cli.main(["vlm", *argv])
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_answers_a_held_out_canvas_like_plain_decoding(capsys, tmp_path, monkeypatch):
    # one timed call of each for the speedup (the default repeats are 3: timing, not what this test checks)
    monkeypatch.setattr(cli_vlm, "SPEEDUP_REPEATS", 1)
    image = tmp_path / "canvas.png"
    assert (
        cli.main(["vlm", "--max-new-tokens", "12", "--seed", "3", "--threads", "1", "--save-image", str(image)]) == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert image.is_file()
    assert report["speedup_vs_plain"] > 0 and report["speedup_timing"]["repeats"] == 1
    assert report["matches_plain"] and report["answer"]["text"] == report["plain_baseline"]["text"]
    assert report["answer"]["text"].startswith("There ")  # a description, as trained
    assert report["answer"]["tau"] > 1.0 and report["plain_baseline"]["tau"] == 1.0
    # the saved canvas answers the same through --image, also with the verification on packed CPU linears
    argv = ["vlm", "--image", str(image), "--max-new-tokens", "12", "--no-baseline", "--packed-linear"]
    assert cli.main(argv) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["answer"]["text"] == report["answer"]["text"] and "plain_baseline" not in again
    assert again["packed_linear"] is True and report["packed_linear"] is False


def test_packed_linear_without_onednn_is_a_usage_error(capsys, monkeypatch):
    import mmspec.models.packed_linear as packed

    monkeypatch.setattr(packed, "_AVAILABLE", False)  # a torch build without oneDNN's packed kernels
    monkeypatch.setattr(cli_vlm, "run", lambda args: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as exc:
        cli.main(["vlm", "--packed-linear"])
    assert exc.value.code == 2 and "--packed-linear" in capsys.readouterr().err
