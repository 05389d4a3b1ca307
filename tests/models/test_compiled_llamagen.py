"""Captured forwards on LlamaGen (`pipe.enable_compile`, `mmspec.decoding.compiled`): one graph and no break per
forward shape, no recompile over whole generations, greedy tokens identical to eager (`eager`, `aot_eager`), the
sampled law under CPU inductor."""

import factories
import pytest
import torch

from mmspec.cache import tree_inputs
from mmspec.decoding.compiled import bucket_width, pad_block
from mmspec.pipelines import SpeculativeARImagePipeline


V, GRID, CLASSES = 16, 4, 4


@pytest.fixture(scope="module")
def parts():
    target = factories.tiny_gpt(0, vocab_size=V, num_classes=CLASSES, block_size=GRID**2, std=0.3)
    near = factories.near_copy(target)
    vq = factories.tiny_vq(V)
    return target, near, vq


def run(pipe, seed=0, **kw):
    kw.setdefault("class_labels", [1])
    return pipe(generator=torch.Generator().manual_seed(seed), output_type="tokens", **kw)


def test_forward_is_one_graph_for_every_block_shape(parts):
    """`_dynamo.explain` of the cached forward: 1 graph, 0 breaks for a 1-token step, a chain and a token tree (the
    memo of `StaticKVCache._run_start` used to break it at every layer)."""
    model = parts[0]
    cache = model.setup_cache(2, 40)
    model.prefill(torch.tensor([1, CLASSES]), cache)

    def forward(ids, cache, *inputs):
        return model(ids, cache, *inputs, validate=False)

    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]])
    blocks = {"token": (torch.zeros(2, 1, dtype=torch.long),), "chain": (torch.zeros(2, 4, dtype=torch.long),),
              "tree": (torch.zeros(2, 4, dtype=torch.long), *tree_inputs(parents, cache.lengths))}  # fmt: skip
    with torch.no_grad():
        for name, (ids, *inputs) in blocks.items():
            explained = torch._dynamo.explain(forward)(ids, cache, *inputs)
            assert (explained.graph_count, explained.graph_break_count) == (1, 0), (name, explained.break_reasons)


def test_padded_block_scores_like_the_block(parts):
    """A chain or tree padded to a bucket gives the block's own outputs (eager): the padding is invisible."""
    model = parts[0]
    parents = torch.tensor([[-1, 0, 0], [-1, 0, 1]])
    ids = torch.tensor([[3, 5, 7], [2, 9, 4]])
    assert bucket_width(3, (1, 6)) == 6 and bucket_width(1, (1, 6)) == 1
    for inputs in ((), None):
        cache = model.setup_cache(2, 40)
        model.prefill(torch.tensor([1, 2]), cache)
        inputs = tree_inputs(parents, cache.lengths) if inputs is None else inputs
        want = model(ids, cache, *inputs, return_hidden=True)
        padded = pad_block(6, ids, *inputs)
        got = model(padded[0], cache, *padded[1:], return_hidden=True)
        torch.testing.assert_close(got.logits[:, :3], want.logits)
        torch.testing.assert_close(got.hidden[:, :3], want.hidden)


METHODS = {
    "plain": dict(acceptance="none"),
    "chain": dict(acceptance="exact", drafter="model", num_draft_tokens=3),
    "jacobi": dict(acceptance="jacobi", jacobi_window=5),
}


@pytest.mark.parametrize("name", METHODS)
def test_no_recompile_over_whole_generations(parts, name):
    """Two whole generations per method (CFG: 2 rows, greedy and sampled): every forward shape compiles exactly once
    (a chain's tail and the shrinking Jacobi window are padded to the widest block: at most 2 target shapes), dynamo's
    own counters agree, and the second call compiles nothing."""
    target, near, vq = parts
    eager = SpeculativeARImagePipeline(target, vq, near)
    pipe = SpeculativeARImagePipeline(target, vq, near).enable_compile(backend="eager")
    method = METHODS[name]
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    first = run(pipe, do_sample=False, **method)
    report = pipe.compile_report()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == sum(r["graphs"] for r in report.values())
    assert torch.equal(first.images, run(eager, do_sample=False, **method).images)
    sampled = run(pipe, seed=3, **method)
    assert torch.equal(sampled.images, run(eager, seed=3, **method).images)
    again = pipe.compile_report()
    assert again["target"]["shapes"] <= 2 and again["target"]["calls"] > report["target"]["calls"]
    for role, counts in again.items():
        assert counts["recompiles"] == 0, (role, counts)
        assert counts["graphs"] == report[role]["graphs"] == counts["shapes"], (role, report, again)
    assert set(again) == ({"target", "drafter"} if name == "chain" else {"target"})


def test_enable_compile_checks_its_arguments(parts):
    target, _, vq = parts
    pipe = SpeculativeARImagePipeline(target, vq)
    with pytest.raises(ValueError, match="mode"):
        pipe.enable_compile(mode="fast")
    with pytest.raises(ValueError, match="backend"):
        pipe.enable_compile(backend="tvm")
    with pytest.raises(ValueError, match="rng must be one of"):
        pipe.enable_compile(verify=True, rng="mt19937")
    with pytest.raises(ValueError, match="needs verify=True"):
        pipe.enable_compile(rng="philox")
    assert pipe.enable_compile(verify=True, rng="philox").compiler.rng == "philox"
    assert pipe.compile_report() == {} and pipe.enable_compile().disable_compile().compiler is None


def test_aot_eager_greedy_tokens_equal_eager(parts):
    """Greedy chain decoding (target buckets 4 and 1, draft shapes 1 and 2) under `aot_eager` (AOT autograd's
    functionalization of the KV cache's in-place writes, the graphs inductor is handed): eager's tokens. Inductor's
    own code for these models is checked by `test_sampled_law_under_inductor` (target and draft, chain) and
    `test_compiled_drafters.test_inductor_eagle_tree_greedy_equal` (target and EAGLE head, tree: eager's tokens)."""
    target, near, vq = parts
    eager = SpeculativeARImagePipeline(target, vq, near)
    pipe = SpeculativeARImagePipeline(target, vq, near).enable_compile(backend="aot_eager")
    method = METHODS["chain"]
    assert torch.equal(run(pipe, do_sample=False, **method).images, run(eager, do_sample=False, **method).images)
    assert all(counts["recompiles"] == 0 for counts in pipe.compile_report().values())


@pytest.mark.parametrize("name", ["chain", "jacobi"])
def test_row_counts_stay_on_buckets_at_batch_six(parts, name):
    """Six rows finishing at different rounds (sampled, per-row generators; then greedy): compaction keeps the
    captured forwards on row buckets (6, 4, 2, 1 items: `row_bucket`; two CFG rows each), not one shape per count of
    rows left; padding rows
    commit and emit nothing, so tokens equal eager's, and nothing recompiles."""
    target, near, vq = parts
    eager = SpeculativeARImagePipeline(target, vq, near)
    pipe = SpeculativeARImagePipeline(target, vq, near).enable_compile(backend="eager")
    method, labels = METHODS[name], [0, 1, 2, 3, 1, 2]
    for do_sample in (True, False):
        kw = dict(class_labels=labels, do_sample=do_sample, output_type="tokens", **method)
        gens = [torch.Generator().manual_seed(i) for i in range(6)]
        want = eager(generator=[torch.Generator().manual_seed(i) for i in range(6)], **kw).images
        assert torch.equal(pipe(generator=gens, **kw).images, want)
    for (role, _), forward in pipe.compiler.forwards.items():
        rows = {shape[0][0][0] for shape in forward.shapes}  # the first argument's rows: the token block
        assert len(rows) > 1 and rows <= {12, 8, 4, 2}, (role, rows)  # rows did leave, onto the buckets
        assert forward.recompiles == 0, (role, forward.report())


@pytest.mark.slow
def test_sampled_law_under_inductor():
    """The chi-square law test of `test_pipeline_ar_image.test_sampling_marginals_match_plain` (speculative vs plain
    sampling, per position, CFG) with the target and draft forwards under CPU inductor, on a 2 x 2 token grid: 2000
    images, rows finishing at different rounds (compacted onto row buckets), tokens 2-4 follow eager plain sampling's
    law (sampling and verification stay eager, per-row draws outside the graphs)."""
    from scipy import stats as scipy_stats

    target = factories.tiny_gpt(0, vocab_size=V, num_classes=CLASSES, block_size=4, std=0.3)
    near = factories.near_copy(target)
    vq = factories.tiny_vq(V, ch_mult=(1, 2))
    n = 2000
    plain = run(SpeculativeARImagePipeline(target, vq), seed=1, num_images_per_prompt=n, acceptance="none").images
    pipe = SpeculativeARImagePipeline(target, vq, near).enable_compile()
    spec = run(pipe, seed=2, num_images_per_prompt=n, **METHODS["chain"]).images
    for j in (1, 2, 3):
        a, b = (torch.bincount(x[:, j], minlength=V).numpy() for x in (plain, spec))
        keep = (a + b) > 0
        p = scipy_stats.chi2_contingency([a[keep], b[keep]])[1]
        assert p > 1e-3, f"position {j}: p={p:.2e} plain={a.tolist()} spec={b.tolist()}"
    rows = {shape[0][0][0] for shape in pipe.compiler.forwards[("target", id(target))].shapes}
    assert len(rows) > 1 and all(counts["recompiles"] == 0 for counts in pipe.compile_report().values()), rows
