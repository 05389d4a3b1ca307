"""`mmspec bench vlm --workload templated|free-form|readout`: free-form runs held-out canvases x held-out prompts
(multi-turn included) and records them; readout runs held-out 4x4 grids, scores every answer against its grid and
reports acceptance by depth; templated keeps today's defaults; bad combinations are usage errors before loading."""

import argparse

import pytest
from vlm_fixtures import tiny_llava, tiny_processor

from mmspec import cli
from mmspec.data.vlm_prompts import KINDS, split_templates
from mmspec.eval import bench_vlm
from mmspec.models.hf.draft import truncated_draft
from mmspec.pipelines.vlm import SpeculativeVLMPipeline


def _pipe():
    target = tiny_llava(4, seed=1)
    pipe = SpeculativeVLMPipeline(target, tiny_processor(), draft_model=truncated_draft(target, 3))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _args(*argv):
    parser = argparse.ArgumentParser()
    bench_vlm.add_arguments(parser)
    return parser.parse_args(["--methods", "plain,draft-model", "--max-new-tokens", "6", *argv])


def test_free_form_runs_held_out_prompts_of_every_kind_and_records_them():
    report = bench_vlm.run(_args("--workload", "free-form", "--num-prompts", "5", "--batch-size", "1,2"), pipe=_pipe())
    assert report["workload"] == "free-form" and report["prompt"] is None
    held = set(split_templates()["held-out"])
    prompts = report["prompts"]
    assert len(prompts) == 5 and {p["kind"] for p in prompts} == set(KINDS)
    assert all(p["template"] in held for p in prompts)
    assert [p["turns"] for p in prompts if p["kind"] == "follow-up"] == [2]
    for table in report["by_batch_size"].values():
        assert table["draft-model"]["matches_plain"] and table["draft-model"]["tau"] > 1.0
    assert report["knobs"]["max_new_tokens"] == 6


def test_free_form_answers_differ_from_templated_ones_and_templated_keeps_its_defaults():
    pipe = _pipe()
    templated = bench_vlm.run(_args("--num-prompts", "2"), pipe=pipe)
    assert templated["workload"] == "templated" and templated["prompt"] == "Describe the image."
    assert "prompts" not in templated
    parser = argparse.ArgumentParser()
    bench_vlm.add_arguments(parser)
    args = parser.parse_args(["--workload", "free-form"])
    bench_vlm.resolve_workload_defaults(args)
    assert args.max_new_tokens == 128 and args.prompt is None
    args = parser.parse_args([])
    bench_vlm.resolve_workload_defaults(args)
    assert args.max_new_tokens == 96 and args.prompt == "Describe the image."
    with pytest.raises(ValueError, match="canvases"):
        bench_vlm.run(_args("--workload", "free-form", "--num-prompts", "2"), pipe=pipe, canvases=[None, None])


def test_readout_runs_held_out_grids_and_reports_accuracy_and_acceptance_by_depth():
    from mmspec.data import grids

    report = bench_vlm.run(_args("--workload", "readout", "--num-prompts", "4", "--batch-size", "1,2"), pipe=_pipe())
    assert report["workload"] == "readout" and report["knobs"]["max_new_tokens"] == 6
    held = set(grids.split_templates()["held-out"])
    assert [p["kind"] for p in report["prompts"]] == list(grids.KINDS)
    assert all(p["template"] in held for p in report["prompts"])
    for table in report["by_batch_size"].values():
        row = table["draft-model"]
        assert row["matches_plain"] and 0 <= row["digit_accuracy"] <= 1 and 0 <= row["find_accuracy"] <= 1
        hist, depth = row["accept_histogram"], row["acceptance_by_depth"]
        assert len(hist) == 5 and len(depth) == 4 and sum(hist) > 0
        assert all(a >= b for a, b in zip(depth, depth[1:]))  # at least d accepted: falls with d
        assert table["plain"]["acceptance_by_depth"] is None


def test_acceptance_by_depth_sums_to_the_pipeline_s_own_tau():
    """One answer at batch 1: the histogram's tail shares sum to the drafts accepted per round the stats count."""
    report = bench_vlm.run(_args("--workload", "readout", "--num-prompts", "1"), pipe=_pipe())
    row = report["by_batch_size"]["1"]["draft-model"]
    assert sum(row["acceptance_by_depth"]) == pytest.approx(row["tau_without_bonus"], abs=1e-3)


def test_readout_accuracy_reads_true_answers_as_right_and_counts_wrong_cells():
    from mmspec.data import grids
    from mmspec.models.hf.smollm2 import load_smollm2

    tokenizer = load_smollm2()[1]
    _, prompts, layouts = bench_vlm.readout_inputs(8, seed=0)
    answers = [tokenizer.encode(grids.answer(lay, p), add_special_tokens=False) for lay, p in zip(layouts, prompts)]
    assert bench_vlm.readout_accuracy(tokenizer, answers, prompts, layouts) == {
        "digit_accuracy": 1.0, "find_accuracy": 1.0, "follows_form": 1.0, "exact": 1.0}  # fmt: skip
    rows = [i for i, p in enumerate(prompts) if p.kind == "rows"]
    answers[rows[0]] = tokenizer.encode("Row 1: 0 0 0 0.", add_special_tokens=False)  # 4 cells stated, 12 missing
    right = sum(layouts[rows[0]].label(1, c) == 0 for c in range(1, 5))
    got = bench_vlm.readout_accuracy(tokenizer, answers, prompts, layouts)
    assert got["digit_accuracy"] == pytest.approx((16 * 5 + right) / (16 * 6)) and got["exact"] == 7 / 8


def _refuse(*args, **kwargs):
    raise AssertionError("reached the bench run although the arguments were invalid")


@pytest.mark.parametrize(
    "argv, flag, words",
    [
        (["--workload", "free-form", "--prompt", "Tell a story."], "--prompt", "free-form"),
        (["--workload", "free-form", "--min-digits", "1"], "--min-digits", "free-form"),
        (["--workload", "story"], "--workload", "invalid choice"),
        (["--workload", "readout", "--prompt", "Read it."], "--prompt", "readout"),
    ],
)
def test_bad_workload_combinations_are_usage_errors_before_loading(argv, flag, words, capsys, monkeypatch):
    monkeypatch.setattr(bench_vlm, "run", _refuse)
    monkeypatch.setattr(SpeculativeVLMPipeline, "from_zoo", _refuse)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "vlm", *argv])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert f"argument {flag}" in last and words in last, err
