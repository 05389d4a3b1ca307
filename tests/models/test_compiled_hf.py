"""Captured forwards on the transformers adapter (`HFTarget`: SmolLM2-style Llama LM, LLaVA): the whole decoder is
one `fullgraph` graph per (block width, attention-window bucket) -- no break (fullgraph raises on one), no
`layer_idx` recompile -- and greedy tokens are eager's."""

import pytest
import torch
from vlm_fixtures import images, prompts, tiny_llava, tiny_lm, tiny_processor, tiny_tokenizer

from mmspec.models.hf.draft import truncated_draft
from mmspec.pipelines.vlm import SpeculativeVLMPipeline


@pytest.fixture(scope="module", params=["lm", "llava"])
def pipes(request):
    target = tiny_llava(4, seed=1) if request.param == "llava" else tiny_lm(4, seed=1)
    processor = tiny_processor() if request.param == "llava" else tiny_tokenizer()
    made = [SpeculativeVLMPipeline(target, processor, draft_model=truncated_draft(target, 3)) for _ in range(2)]
    for pipe in made:
        pipe.set_progress_bar_config(disable=True)
    return request.param, made[0], made[1].enable_compile(backend="eager")


@pytest.mark.parametrize("knobs", [dict(acceptance="none"), dict(acceptance="greedy", num_draft_tokens=3)])
def test_greedy_equal_and_no_recompile(pipes, knobs):
    kind, eager, pipe = pipes
    ims = images(1) if kind == "llava" else None
    before = pipe.compile_report().get("target", {"graphs": 0})["graphs"]
    for _ in range(2):  # the second call compiles nothing
        want = eager(images=ims, prompt=prompts(1), max_new_tokens=24, output_type="ids", **knobs).sequences
        got = pipe(images=ims, prompt=prompts(1), max_new_tokens=24, output_type="ids", **knobs).sequences
        assert torch.equal(got, want)
        report = pipe.compile_report()["target"]
        assert report["recompiles"] == 0 and report["graphs"] == report["shapes"], report
        assert report["graphs"] - before <= 1  # one new block width per method (1, then K + 1), one window bucket
        before = report["graphs"]


@pytest.mark.slow
def test_sampled_law_under_aot_eager():
    """The VLM pipeline's chi-square law test (`test_pipeline_vlm.test_sampled_first_tokens_follow_the_target_law`)
    with the target's and the draft LM's forwards captured (`aot_eager`: dynamo's graphs through AOT autograd's
    functionalization, the graphs inductor is handed, without its code generation): tokens 2 and 3 (drafted,
    verified, resampled; per-row generators, drawn eagerly outside the graphs) follow the exact target law. The
    suite's one law test under CPU inductor is LlamaGen's (`test_compiled_llamagen.test_sampled_law_under_inductor`)."""
    from factories import assert_first_tokens_follow
    from test_pipeline_vlm import _exact_marginals

    target = tiny_lm(4, seed=1)
    pipe = SpeculativeVLMPipeline(target, tiny_tokenizer(), draft_model=truncated_draft(target, 3))
    pipe.enable_compile(backend="aot_eager")
    pipe.set_progress_bar_config(disable=True)
    text = prompts(1, seed=5)
    ids, _, _ = pipe.encode(None, text, None, "cpu")
    temperature, n, eos = 1.5, 3000, pipe.eos_token_ids()[0]
    law2, law3 = _exact_marginals(pipe.model, ids, temperature, eos)
    gens = [torch.Generator().manual_seed(10_000 + i) for i in range(n)]
    out = pipe(prompt=text * n, max_new_tokens=3, do_sample=True, temperature=temperature, acceptance="exact",
               drafter="model", num_draft_tokens=3, generator=gens, output_type="ids")  # fmt: skip
    assert out.stats.mean_accepted_drafts > 0.05
    assert_first_tokens_follow(out.sequences, law2, law3, n)
    report = pipe.compile_report()["target"]
    assert report["recompiles"] == 0 and report["graphs"] == report["shapes"], report
