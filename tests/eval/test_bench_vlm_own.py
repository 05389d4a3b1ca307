"""`mmspec bench vlm --target FOLDER --prompts FILE --eagle-head HEAD`: your own VLM measured on your own prompts and
images (issue 29: "prove it lossless, measure it"): a tiny Qwen2.5-VL folder and an EAGLE-3 head saved for it; every
row's greedy answers equal plain's at batch 1 and on a ragged batch of 2 (different image sizes, two images in one
prompt, a text-only prompt), transformers' generate included; flags that cannot work are usage errors before
loading."""

import json

import pytest
from own_vlm_fixtures import save_drafters, save_own_vlm, usage_error

from mmspec.cli import main as mmspec


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """`(folder, prompts, head folder, draft folder)`: `own_vlm_fixtures.save_own_vlm` and `save_drafters`."""
    root = tmp_path_factory.mktemp("bench-own")
    folder, prompts, model = save_own_vlm(root)
    return folder, prompts, *save_drafters(root, model, folder)


ROWS = ["plain", "hf-plain", "hf-assisted", "draft-model", "draft-model-frspec", "draft-model-calibrated", "eagle",
        "eagle-calibrated"]  # fmt: skip


def test_own_vlm_rows_match_plain_and_transformers(own, tmp_path):
    folder, prompts, head, draft = own
    out = tmp_path / "own.json"
    mmspec(["bench", "vlm", "--target", str(folder), "--prompts", str(prompts), "--eagle-head", str(head), "--draft",
            str(draft), "--batch-size", "1,2", "--num-prompts", "4", "--max-new-tokens", "8", "--methods",
            ",".join(ROWS), "--threads", "1", "--device", "cpu", "--json", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    assert report["workload"] == "file" and report["target"] == str(folder) and report["zoo"] is None
    assert report["num_prompts"] == 4 and report["prompts_file"] == str(prompts)
    assert report["draft"] == str(draft) and report["eagle_head"] == str(head)
    tables = report["by_batch_size"]
    assert list(tables["1"]) == ROWS and list(tables["2"]) == [r for r in ROWS if not r.startswith("hf-")]
    for bs, table in tables.items():  # transformers' rows run at batch 1 only
        for name, row in table.items():
            assert row["matches_plain"] is True, (bs, name)
        assert table["eagle"]["tau"] >= 1.0 and table["draft-model"]["tau"] >= 1.0


def test_own_vlm_flags_that_cannot_work_are_usage_errors_before_loading(own, capsys, monkeypatch):
    from mmspec.models.hf import vlm_folder

    folder, prompts, head, draft = own
    monkeypatch.setattr(vlm_folder, "load_target_vlm", None)  # nothing may load
    base = ["bench", "vlm", "--device", "cpu"]
    err = usage_error(mmspec, [*base, "--target", str(folder)], capsys)
    assert "argument --target: needs --prompts" in err
    err = usage_error(mmspec, [*base, "--eagle-head", str(head), "--prompts", str(prompts)], capsys)
    assert "argument --eagle-head: only with --target" in err
    err = usage_error(mmspec, [*base, "--prompts", str(prompts), "--workload", "free-form"], capsys)
    assert "argument --prompts: not allowed with --workload" in err
    err = usage_error(
        mmspec, [*base, "--target", str(folder), "--prompts", str(prompts), "--methods", "plain,eagle"], capsys
    )
    assert "argument --methods: eagle cannot run on --target" in err and "need --eagle-head" in err
    err = usage_error(
        mmspec, [*base, "--target", str(folder), "--prompts", str(prompts), "--methods", "hf-assisted"], capsys
    )
    assert "argument --methods: hf-assisted cannot run on --target" in err and "--draft" in err
    err = usage_error(mmspec, [*base, "--draft", str(draft), "--prompts", str(prompts)], capsys)
    assert "argument --draft: only with --target" in err
    err = usage_error(
        mmspec, [*base, "--target", str(folder), "--prompts", str(prompts), "--draft", str(head)], capsys
    )
    assert "argument --draft" in err and "not a vlm-draft folder" in err
    err = usage_error(mmspec, [*base, "--target", str(folder), "--prompts", str(prompts), "--eagle-head", str(head),
                        "--methods", "plain,draft-model"], capsys)  # fmt: skip
    assert "argument --methods: draft-model cannot run on --target" in err
    err = usage_error(
        mmspec, [*base, "--target", str(folder), "--prompts", str(prompts), "--eagle-head", str(folder)], capsys
    )
    assert "argument --eagle-head" in err
    err = usage_error(mmspec, [*base, "--target", str(folder), "--prompts", str(prompts), "--batch-size", "6"], capsys)
    assert "argument --batch-size: 6 is more than the 5 prompt(s) used" in err
    bad = prompts.parent / "bad.jsonl"
    bad.write_text('{"image": "images/missing.png", "prompt": "w1"}\n')
    err = usage_error(mmspec, [*base, "--target", str(folder), "--prompts", str(bad)], capsys)
    assert f"argument --prompts: {bad}:1" in err and "does not exist" in err
