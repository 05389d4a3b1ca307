"""`mmspec vlm --target FOLDER --head HEAD | --draft DRAFT --image I`: your own VLM asked about your image, drafted by
the head or draft LM trained for it (a tiny Qwen2.5-VL folder, `own_vlm_fixtures`): the answer equals plain
decoding's; flags that cannot work are usage errors before anything loads."""

import pytest
from own_vlm_fixtures import save_drafters, save_own_vlm, usage_error

from mmspec.cli.vlm import main as vlm


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-own")
    folder, prompts, model = save_own_vlm(root)
    head, draft = save_drafters(root, model, folder)
    return folder, root / "images" / "2.png", head, draft


@pytest.mark.parametrize("drafter", ["eagle", "model"])
def test_own_vlm_answers_as_plain_decoding(own, drafter, capsys):
    import json

    folder, image, head, draft = own
    chosen = ["--head", str(head)] if drafter == "eagle" else ["--draft", str(draft)]
    vlm(["--target", str(folder), *chosen, "--drafter", drafter, "--image", str(image), "--prompt", "w1 w2",
         "--acceptance", "greedy", "--max-new-tokens", "8", "--threads", "1"])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert report["matches_plain"] is True and report["target"] == str(folder)
    assert report["answer"]["new_tokens"] == report["plain_baseline"]["new_tokens"] > 0
    assert report["answer"]["tau"] >= 1.0


def test_own_vlm_flags_that_cannot_work_are_usage_errors_before_loading(own, capsys, monkeypatch):
    from mmspec.models.hf import vlm_folder

    folder, image, head, draft = own
    monkeypatch.setattr(vlm_folder, "load_target_vlm", None)  # nothing may load
    target = ["--target", str(folder)]
    cases = [
        (target + ["--head", str(head)], "needs --image"),
        (target + ["--image", str(image)], "eagle on --target needs --head"),
        (target + ["--image", str(image), "--drafter", "model"], "model on --target needs --draft"),
        (target + ["--image", str(image), "--eagle-head", "vispec"], "argument --eagle-head: names a zoo head"),
        (target + ["--image", str(image), "--head", str(head), "--draft", str(draft)], "argument --draft: not used"),
        (target + ["--image", str(image), "--head", str(draft)], "argument --head"),
        (target + ["--image", str(image), "--drafter", "model", "--draft", str(head)], "not a vlm-draft folder"),
        (["--head", str(head)], "argument --head: only with --target"),
        (["--target", str(image.parent), "--image", str(image)], "argument --target"),
    ]
    for argv, needle in cases:
        err = usage_error(vlm, argv, capsys)
        assert needle in err, (argv, err)
