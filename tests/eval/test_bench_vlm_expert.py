"""`bench vlm --specvlm-expert`: the SpecVLM row's gate overridden for the per-compressor ablation."""

import pytest
from factories import parse_flags
from vlm_fixtures import quick_eagle_pipe

from mmspec.eval import bench_vlm


def _parse(*argv):
    return parse_flags(bench_vlm.add_arguments, *argv)


def test_unknown_expert_and_expert_without_the_row_are_usage_errors(capsys):
    with pytest.raises(SystemExit):
        _parse("--specvlm-expert", "medusa")
    parser, args = _parse("--specvlm-expert", "pool", "--methods", "plain,eagle")
    with pytest.raises(SystemExit) as err:
        bench_vlm.check_args(parser, args)
    assert err.value.code == 2 and "--specvlm-expert" in capsys.readouterr().err


def test_forced_expert_reaches_the_head_and_the_report():
    from test_bench_vlm_vision import _args, setup  # noqa: F401
    from test_vision_drafters import vision_head

    pipe, canvases = quick_eagle_pipe()
    heads = {"specvlm": vision_head(pipe.eagle_head, pipe.model, "specvlm")}
    for expert, tokens in (("text-only", 0), ("pool", 4)):  # a 4 x 4 image grid, ratio 4
        args = _args("--methods", "plain,specvlm", "--specvlm-expert", expert)
        report = bench_vlm.run(args, pipe=pipe, canvases=canvases, heads=heads)
        row = report["by_batch_size"]["1"]["specvlm"]
        assert row["gate_choice"] == {expert: 4} and row["draft_image_tokens"] == tokens and row["matches_plain"]
        assert report["knobs"]["specvlm_expert"] == expert


def test_sampled_speedups_compare_time_per_generated_token():
    """Sampled answers differ in length between methods (the same law, other draws): a sampled run's speedup is plain's
    time per generated token over the method's, not a ratio of latencies over different answers."""
    from test_bench_vlm_vision import _args

    pipe, canvases = quick_eagle_pipe()
    args = _args("--methods", "plain,eagle", "--do-sample", "--temperature", "0.7", "--max-new-tokens", "24")
    table = bench_vlm.run(args, pipe=pipe, canvases=canvases)["by_batch_size"]["1"]
    plain, eagle = table["plain"], table["eagle"]
    assert eagle["speedup"] == pytest.approx(plain["s_per_token"] / eagle["s_per_token"])
    assert eagle["decode_speedup"] == pytest.approx(eagle["tokens_per_s"] / plain["tokens_per_s"])
