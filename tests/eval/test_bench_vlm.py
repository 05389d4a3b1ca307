"""`mmspec bench vlm` on a tiny LLaVA: every method runs, greedy outputs agree, the report has every field."""

import argparse

import pytest
import torch
from vlm_fixtures import images, tiny_llava, tiny_processor, train_tiny_head

from mmspec.eval import bench_vlm
from mmspec.models.hf.draft import truncated_draft
from mmspec.pipelines.vlm import SpeculativeVLMPipeline


def test_bench_vlm_reports_every_method(tmp_path):
    target = tiny_llava(4, seed=1)
    pipe = SpeculativeVLMPipeline(target, tiny_processor(), draft_model=truncated_draft(target, 3))
    pipe.set_progress_bar_config(disable=True)
    canvases = images(4, seed=7)
    pipe.register_modules(eagle_head=train_tiny_head(pipe, canvases, ["w1 w2"] * 4, steps=60))
    parser = argparse.ArgumentParser()
    bench_vlm.add_arguments(parser)
    args = parser.parse_args(["--batch-size", "1,2", "--max-new-tokens", "12", "--prompt", "w1 w2"])
    report = bench_vlm.run(args, pipe=pipe, canvases=canvases)
    b1, b2 = report["by_batch_size"]["1"], report["by_batch_size"]["2"]
    frspec = {m for m in bench_vlm.METHODS if "frspec" in m}  # the tiny head has no draft vocabulary
    assert set(b1) == set(bench_vlm.METHODS) - frspec and set(b2) == {
        "plain",
        "draft-model",
        "draft-model-confident",
        "draft-model-tree",
        "eagle",
        *(set(bench_vlm.ADAPTIVE) - frspec),
    }
    for table in (b1, b2):
        for name, entry in table.items():
            assert entry["matches_plain"], name
            assert entry["latency_s"] > 0 and entry["speedup"] > 0 and entry["tokens_per_s"] > 0
    assert b1["plain"]["tau"] == 1.0 and b1["plain"]["tau_without_bonus"] == 0.0
    assert b1["draft-model"]["tau"] > 1.0 and b1["draft-model-tree"]["tau"] > 1.0 and b1["eagle"]["tau"] >= 1.0
    assert b1["hf-assisted"]["draft_calls"] > 0 and b1["hf-assisted"]["tau"] is None
    assert report["knobs"]["eagle-cost"]["draft_length"] == "cost" and b1["eagle-cost"]["tau"] >= 1.0
    # the -cost rows are priced by the verification costs measured first (widths 1..K_max + 1), the same table each
    costs = report["knobs"]["eagle-cost"]["verify_costs"]
    assert report["knobs"]["cost_model"] == "table" and len(costs) == args.adaptive_max_tokens + 1
    assert (
        costs[0] == 1.0 and all(c > 0 for c in costs) and report["knobs"]["draft-model-cost"]["verify_costs"] == costs
    )
    assert "verify_costs" not in report["knobs"]["eagle-heuristic"]
    assert "speedup_vs_hf_assisted" in b1["eagle"] and report["knobs"]["hf-assisted"]["num_assistant_tokens"]


def test_bench_vlm_packed_linear_runs_every_row_on_the_same_kernels():
    """`--packed-linear`: ours and transformers' rows run on the packed modules (the verification took the packed
    kernel), every greedy row still equals plain, the report says so, and the pipeline handed in leaves unpacked."""
    from mmspec.models.packed_linear import PackedLinear, packing_available

    if not packing_available():
        pytest.skip("this torch build has no oneDNN CPU kernels")
    target = tiny_llava(4, seed=1)
    pipe = SpeculativeVLMPipeline(target, tiny_processor(), draft_model=truncated_draft(target, 3))
    pipe.set_progress_bar_config(disable=True)
    canvases = images(2, seed=7)
    parser = argparse.ArgumentParser()
    bench_vlm.add_arguments(parser)
    args = parser.parse_args(["--max-new-tokens", "12", "--prompt", "w1 w2", "--packed-linear", "--device", "cpu",
                              "--methods", "plain,hf-assisted,draft-model,draft-model-heuristic"])  # fmt: skip
    calls = []
    forward = PackedLinear.forward
    PackedLinear.forward = lambda self, x: calls.append(x.shape[:-1].numel()) or forward(self, x)
    try:
        report = bench_vlm.run(args, pipe=pipe, canvases=canvases)
    finally:
        PackedLinear.forward = forward
    b1 = report["by_batch_size"]["1"]
    assert report["packed_linear"] is True and set(b1) == {
        "plain",
        "hf-assisted",
        "draft-model",
        "draft-model-heuristic",
    }
    assert all(entry["matches_plain"] for entry in b1.values())
    assert any(1 < rows <= 5 for rows in calls)  # a K = 4 verification went through the packed modules
    assert not any(isinstance(m, PackedLinear) for m in pipe.model.modules())


def test_bench_vlm_packed_linear_unpacks_when_a_row_raises():
    """The pipeline handed in leaves unpacked also when the run fails after packing (here: an unknown head row)."""
    from mmspec.models.packed_linear import PackedLinear, packing_available

    if not packing_available():
        pytest.skip("this torch build has no oneDNN CPU kernels")
    target = tiny_llava(4, seed=1)
    pipe = SpeculativeVLMPipeline(target, tiny_processor(), draft_model=truncated_draft(target, 3))
    parser = argparse.ArgumentParser()
    bench_vlm.add_arguments(parser)
    args = parser.parse_args(["--max-new-tokens", "4", "--prompt", "w1 w2", "--packed-linear", "--device", "cpu",
                              "--methods", "plain"])  # fmt: skip
    with pytest.raises(ValueError, match="unknown row"):
        bench_vlm.run(args, pipe=pipe, canvases=images(1, seed=7), heads={"not-a-head": None})
    assert any(isinstance(m, torch.nn.Linear) for m in pipe.model.modules())
    assert not any(isinstance(m, PackedLinear) for m in pipe.model.modules())
