"""`mmspec bench vlm` and `mmspec vlm` with vision-aware heads: the rows `vispec` / `specvlm` / `msd` run beside the
others (greedy and sampled at T = 0.7, batch 1 and 4) and report the draft-side image tokens; a row or head whose
zoo folder is missing is a usage error before anything loads."""

import argparse
import shutil

import pytest
from vision_seam_fixtures import StrideImageHead, stride_head_from
from vlm_fixtures import IMAGE_TOKENS, images, tiny_llava, tiny_processor, train_tiny_head

from mmspec import cli
from mmspec.cli import vlm as cli_vlm
from mmspec.drafters.vision_eagle import VISION_POLICIES
from mmspec.eval import bench_vlm
from mmspec.models import DEFAULT_ZOO
from mmspec.models.hf.draft import truncated_draft
from mmspec.pipelines.vlm import SpeculativeVLMPipeline


@pytest.fixture(scope="module")
def setup():
    target = tiny_llava(4, seed=1)
    pipe = SpeculativeVLMPipeline(target, tiny_processor(), draft_model=truncated_draft(target, 3))
    pipe.set_progress_bar_config(disable=True)
    canvases = images(4, seed=7)
    pipe.register_modules(eagle_head=train_tiny_head(pipe, canvases, ["w1 w2"] * 4, steps=60))
    return pipe, canvases, {"vispec": stride_head_from(pipe.eagle_head)}


def _args(*argv):
    parser = argparse.ArgumentParser()
    bench_vlm.add_arguments(parser)
    return parser.parse_args(["--max-new-tokens", "12", "--prompt", "w1 w2", "--num-prompts", "4", *argv])


def test_vision_rows_run_beside_the_others_and_report_draft_image_tokens(setup):
    pipe, canvases, heads = setup
    report = bench_vlm.run(_args("--batch-size", "1,4"), pipe=pipe, canvases=canvases, heads=heads)
    b1, b4 = report["by_batch_size"]["1"], report["by_batch_size"]["4"]
    assert "vispec" in b1 and "vispec" in b4 and "specvlm" not in b1  # rows without a head are skipped
    for table in (b1, b4):
        assert table["vispec"]["matches_plain"] and table["vispec"]["tau"] > 1.0
        assert table["vispec"]["draft_image_tokens"] == IMAGE_TOKENS // StrideImageHead.stride
        assert table["eagle"]["draft_image_tokens"] == IMAGE_TOKENS == table["draft-model"]["draft_image_tokens"]
        assert table["plain"]["draft_image_tokens"] is None and table["vispec"]["gate_choice"] is None
    assert b1["hf-assisted"]["draft_image_tokens"] == IMAGE_TOKENS and b1["hf-plain"]["draft_image_tokens"] is None
    assert report["knobs"]["vispec"] == report["knobs"]["eagle"]


def test_sampled_runs_at_temperature_07_and_batch_4(setup):
    pipe, canvases, heads = setup
    args = _args("--batch-size", "1,4", "--do-sample", "--temperature", "0.7", "--methods", "plain,eagle,vispec")
    report = bench_vlm.run(args, pipe=pipe, canvases=canvases, heads=heads)
    assert report["knobs"]["do_sample"] is True and report["knobs"]["temperature"] == 0.7
    assert report["knobs"]["vispec"]["acceptance"] == "exact"
    for table in report["by_batch_size"].values():
        assert set(table) == {"plain", "eagle", "vispec"}
        for entry in table.values():
            assert entry["matches_plain"] is None  # sampled: the target's law, not plain's tokens
        assert table["vispec"]["tau"] > 1.0 and table["vispec"]["draft_image_tokens"] == IMAGE_TOKENS // 4
    # answer i draws from its own generator: batch 1 and batch 4 give the same plain answers
    again = bench_vlm.run(args, pipe=pipe, canvases=canvases, heads=heads)
    assert (
        again["by_batch_size"]["1"]["plain"]["mean_new_tokens"]
        == report["by_batch_size"]["4"]["plain"]["mean_new_tokens"]
    )


def test_the_three_vision_heads_as_bench_rows_greedy_and_sampled(setup):
    """The real `VisionEagleHead`s (tiny, random policies on a fitted EAGLE layer) as the `vispec` / `specvlm` /
    `msd` rows: greedy answers equal plain's at batch 1 and 4, sampled runs at T = 0.7 and batch 4 go through, every
    row reports its draft-side image tokens and SpecVLM its gate's choices (answers per expert)."""
    from test_vision_drafters import NUM_QUERIES, vision_head

    pipe, canvases, _ = setup
    heads = {name: vision_head(pipe.eagle_head, pipe.model, name) for name in VISION_POLICIES}
    methods = "plain,eagle,vispec,specvlm,msd"
    greedy = bench_vlm.run(_args("--batch-size", "1,4", "--methods", methods), pipe=pipe, canvases=canvases,
                           heads=heads)  # fmt: skip
    sampled = bench_vlm.run(_args("--batch-size", "4", "--methods", methods, "--do-sample", "--temperature", "0.7"),
                            pipe=pipe, canvases=canvases, heads=heads)  # fmt: skip
    tables = [*greedy["by_batch_size"].values(), sampled["by_batch_size"]["4"]]
    for table in tables:
        assert set(table) == set(methods.split(","))
        assert table["vispec"]["draft_image_tokens"] == NUM_QUERIES - 1
        assert table["msd"]["draft_image_tokens"] == IMAGE_TOKENS
        assert 0 <= table["specvlm"]["draft_image_tokens"] <= IMAGE_TOKENS
        assert sum(table["specvlm"]["gate_choice"].values()) == 4  # one choice per answer
        assert set(table["specvlm"]["gate_choice"]) <= set(heads["specvlm"].vision.names)
    for table in greedy["by_batch_size"].values():
        assert all(table[name]["matches_plain"] for name in VISION_POLICIES)
    assert all(sampled["by_batch_size"]["4"][name]["matches_plain"] is None for name in VISION_POLICIES)


def _refuse(*args, **kwargs):
    raise AssertionError("a model was loaded although the arguments were invalid")


def _zoo_without(tmp_path, *missing):
    """A copy of the shipped zoo's VLM config folders (config files only), without `missing`."""
    zoo = tmp_path / "zoo"
    for folder in ("mnist-vlm", "mnist-vlm-draft", "mnist-vlm-eagle", "mnist-vlm-vispec", "mnist-vlm-msd"):
        if folder in missing:
            continue
        source = DEFAULT_ZOO / folder if (DEFAULT_ZOO / folder).is_dir() else DEFAULT_ZOO / "mnist-vlm-eagle"
        shutil.copytree(source, zoo / folder, ignore=lambda d, names: [n for n in names if not n.endswith(".json")])
    return zoo


@pytest.mark.parametrize(
    "argv, flag, words",
    [
        (["--methods", "plain,specvlm"], "--methods", "mnist-vlm-specvlm"),
        (["--do-sample", "--methods", "plain,hf-plain"], "--methods", "greedy only"),
        (["--temperature", "0.7"], "--temperature", "--do-sample"),
    ],
)
def test_bench_usage_errors_before_loading(argv, flag, words, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_vlm, "run", _refuse)
    monkeypatch.setattr(SpeculativeVLMPipeline, "from_zoo", _refuse)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "vlm", "--zoo", str(_zoo_without(tmp_path, "mnist-vlm-specvlm")), *argv])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert f"argument {flag}" in last and words in last, err


def test_bench_default_rows_are_the_heads_the_zoo_has(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(bench_vlm, "run", lambda args: seen.setdefault("methods", args.methods) and {})
    zoo = _zoo_without(tmp_path, "mnist-vlm-specvlm")
    cli.main(["bench", "vlm", "--zoo", str(zoo)])
    assert {"eagle", "vispec", "msd"} <= set(seen["methods"]) and "specvlm" not in seen["methods"]
    seen.clear()
    cli.main(["bench", "vlm", "--zoo", str(zoo), "--do-sample"])
    assert not any(m.startswith("hf-") for m in seen["methods"])


@pytest.mark.parametrize(
    "argv, flag, words",
    [
        (["--eagle-head", "specvlm"], "--eagle-head", "mnist-vlm-specvlm"),
        (["--eagle-head", "vispec", "--drafter", "model"], "--eagle-head", "--drafter eagle"),
        (["--eagle-head", "msd", "--acceptance", "none"], "--eagle-head", "--drafter eagle"),
        (["--eagle-head", "llava"], "--eagle-head", "invalid choice"),
    ],
)
def test_vlm_eagle_head_usage_errors_before_loading(argv, flag, words, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli_vlm, "run", _refuse)
    monkeypatch.setattr(SpeculativeVLMPipeline, "from_zoo", _refuse)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["vlm", "--zoo", str(_zoo_without(tmp_path, "mnist-vlm-specvlm")), *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert f"argument {flag}" in last and words in last, err


def test_vlm_eagle_head_picks_the_zoo_folder(tmp_path, monkeypatch):
    picked = []

    def from_zoo(root=None, name="mnist-vlm", drafters=True, eagle="eagle", **kwargs):
        picked.append(eagle)
        raise SystemExit(0)

    monkeypatch.setattr(SpeculativeVLMPipeline, "from_zoo", from_zoo)
    zoo = _zoo_without(tmp_path)
    for head in ("vispec", None):
        with pytest.raises(SystemExit):
            cli.main(["vlm", "--zoo", str(zoo), "--no-baseline", *(["--eagle-head", head] if head else [])])
    assert picked == ["vispec", "eagle"]


def test_from_zoo_refuses_a_missing_head_folder_by_name(tmp_path):
    with pytest.raises(ValueError, match="mnist-vlm-msd"):
        SpeculativeVLMPipeline.from_zoo(_zoo_without(tmp_path, "mnist-vlm-msd"), eagle="msd")
