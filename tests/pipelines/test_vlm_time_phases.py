"""`time_phases` on the VLM pipeline and `bench vlm --time-phases`: the profile of a decoding round (draft vs verify
time), opt-in, refused when not a bool, and the same answers with it on."""

import pytest
from test_bench_vlm_vision import _args
from vlm_fixtures import prompts, quick_eagle_pipe

from mmspec.eval import bench_vlm


@pytest.fixture(scope="module")
def setup():
    return quick_eagle_pipe()


def test_pipeline_times_the_phases_only_when_asked(setup):
    pipe, canvases = setup
    kw = dict(images=canvases[:2], prompt=prompts(2), max_new_tokens=12, acceptance="greedy", drafter="eagle",
              tree_depth=3, output_type="ids")  # fmt: skip
    off, on = pipe(**kw), pipe(**kw, time_phases=True)
    assert off.stats.time_draft_s is None and off.stats.time_verify_s is None
    assert on.stats.time_draft_s > 0 and on.stats.time_verify_s > 0
    assert on.sequences.tolist() == off.sequences.tolist()
    with pytest.raises(TypeError, match="time_phases"):
        pipe(**kw, time_phases="yes")


def test_bench_reports_per_round_phase_times(setup):
    pipe, canvases = setup
    common = ("--methods", "plain,eagle", "--max-new-tokens", "12", "--tree-depth", "3")
    table = bench_vlm.run(_args(*common, "--time-phases"), pipe=pipe, canvases=canvases)["by_batch_size"]["1"]
    for name in ("plain", "eagle"):
        assert table[name]["verify_ms_per_round"] > 0
    assert table["eagle"]["draft_ms_per_round"] > table["plain"]["draft_ms_per_round"]  # plain drafts nothing
    report = bench_vlm.run(_args(*common), pipe=pipe, canvases=canvases)
    assert report["time_phases"] is False
    assert report["by_batch_size"]["1"]["eagle"]["draft_ms_per_round"] is None
