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
