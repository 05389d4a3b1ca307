"""Captured forwards on Janus (`SpeculativeJanusPipeline` on `JanusTarget` / `HFTarget`): the decoder's round
forward is one fullgraph graph per block width, no recompile, greedy tokens equal eager's (plain and Jacobi)."""

import pytest
import torch
from janus_fixtures import prompts, tiny_janus, tiny_processor

from mmspec.pipelines import SpeculativeJanusPipeline


@pytest.mark.parametrize("knobs", [dict(acceptance="none"), dict(acceptance="jacobi", jacobi_window=4)])
def test_greedy_equal_and_no_recompile(knobs):
    model, processor = tiny_janus(), tiny_processor()
    eager = SpeculativeJanusPipeline(model, processor)
    pipe = SpeculativeJanusPipeline(model, processor).enable_compile(backend="eager")
    for p in (eager, pipe):
        p.set_progress_bar_config(disable=True)
    for seed in (0, 1):  # the second call compiles nothing
        kw = dict(prompt=prompts(1), do_sample=False, output_type="tokens", guidance_scale=2.0, **knobs)
        want = eager(generator=torch.Generator().manual_seed(seed), **kw).images
        got = pipe(generator=torch.Generator().manual_seed(seed), **kw).images
        assert torch.equal(got, want)
        report = pipe.compile_report()["target"]
        assert report["recompiles"] == 0 and report["graphs"] == report["shapes"] <= 2, report


@pytest.mark.parametrize(
    "knobs",
    [dict(acceptance="jacobi", jacobi_window=4), dict(acceptance="jacobi", jacobi_window=4, jacobi_tree_width=2)],
    ids=["sjd", "sjd-pac"],
)
def test_whole_forward_captured_greedy_equal(knobs):
    """`enable_compile(verify=True)`: `HFTarget.forward` whole -- the block's positions, slots and mask (SJD-PAC: a
    Jacobi tree's ancestry), the decoder, the generation head and the CFG processing -- is one graph per width
    (`mmspec.models.hf.target.scored_forward`): greedy tokens equal eager's on a ragged CFG batch of 2, no
    recompile, and a second call compiles nothing."""
    model, processor = tiny_janus(), tiny_processor()
    eager = SpeculativeJanusPipeline(model, processor)
    pipe = SpeculativeJanusPipeline(model, processor).enable_compile(backend="eager", verify=True)
    for p in (eager, pipe):
        p.set_progress_bar_config(disable=True)
    kw = dict(prompt=prompts(2), do_sample=False, output_type="tokens", guidance_scale=2.0, **knobs)
    want = eager(generator=torch.Generator().manual_seed(0), **kw).images
    assert torch.equal(pipe(generator=torch.Generator().manual_seed(0), **kw).images, want)
    report = pipe.compile_report()
    assert report["target"]["recompiles"] == 0 and report["target"]["calls"] > 0, report
    pipe(generator=torch.Generator().manual_seed(1), **kw)
    again = pipe.compile_report()
    assert all(again[r]["graphs"] == report[r]["graphs"] and again[r]["recompiles"] == 0 for r in report), again
