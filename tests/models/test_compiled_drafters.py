"""Captured drafters (`pipe.enable_compile`, role "drafter"): the EAGLE heads' per-step forward (LlamaGen's
`EagleHead`, the VLM's `TextEagleHead` and `VisionEagleHead`) and the VLM draft LM are one `fullgraph` graph per
shape -- no break, no recompile over whole generations (chains and EAGLE-2 trees) -- and greedy tokens are eager's;
the tree bookkeeping (`mmspec.drafters.tree.grow_tree`) stays eager."""

import factories
import pytest
import torch
from vlm_fixtures import images, prompts, quick_eagle_pipe

from mmspec.cache import chain_inputs
from mmspec.drafters.eagle import CapturedHead, pad_pairs
from mmspec.drafters.vision_eagle import VisionEagleHead
from mmspec.models.hf.draft import truncated_draft
from mmspec.models.llamagen.eagle import EagleHead
from mmspec.models.llamagen.vq import LlamaGenVQ
from mmspec.pipelines import SpeculativeARImagePipeline
from mmspec.pipelines.vlm import SpeculativeVLMPipeline


V, GRID, CLASSES = 16, 4, 4
CHAIN = dict(acceptance="exact", drafter="eagle", tree_depth=3)
TREE = dict(acceptance="exact", drafter="eagle", tree_depth=3, tree_top_k=2, tree_nodes=5)


@pytest.fixture(scope="module")
def image_parts():
    target = factories.tiny_gpt(0, vocab_size=V, num_classes=CLASSES, block_size=GRID**2, std=0.3)
    head = EagleHead.from_target(target, initializer_range=0.3).init_weights(torch.Generator().manual_seed(3)).eval()
    vq = LlamaGenVQ(codebook_size=V, codebook_embed_dim=4, ch=8, ch_mult=(1, 2, 2), z_channels=8, in_channels=1,
                    num_res_blocks=1, norm_num_groups=4).eval()  # fmt: skip
    return target, head, vq


def run(pipe, seed=0, **kw):
    kw.setdefault("class_labels", [1])
    return pipe(generator=torch.Generator().manual_seed(seed), output_type="tokens", **kw).images


def test_eagle_head_step_is_one_graph_per_shape(image_parts):
    """`_dynamo.explain` of the head's forward: 1 graph, 0 breaks for the accepted pairs (padded to depth + 1), a
    chain step and a tree level (explicit positions, slots and cache mask)."""
    target, head, _ = image_parts
    cache = head.setup_cache(2, 32)
    hidden, ids = pad_pairs(torch.randn(2, 1, 32), torch.ones(2, 1, dtype=torch.long), 4)
    pos, slots, _ = chain_inputs(cache.lengths, 2)
    mask = torch.ones(2, 2, 2, dtype=torch.bool)
    shapes = {"pairs": ((hidden, ids, target, cache), {}), "step": ((hidden[:, :1], ids[:, :1], target, cache), {}),
              "tree": ((hidden[:, :2], ids[:, :2], target, cache, pos, slots), {"cache_mask": cache.visibility(slots, mask)})}  # fmt: skip
    with torch.no_grad():
        for name, (args, kwargs) in shapes.items():
            explained = torch._dynamo.explain(lambda *a, **k: head(*a, **k))(*args, validate=False, **kwargs)
            assert (explained.graph_count, explained.graph_break_count) == (1, 0), (name, explained.break_reasons)


@pytest.mark.parametrize("method", [CHAIN, TREE], ids=["chain", "tree"])
def test_image_eagle_no_recompile_greedy_equal(image_parts, method):
    """LlamaGen + EAGLE head (chain: head shapes depth + 1 and 1; tree: depth + 1 and top_k): greedy and sampled
    tokens equal eager's, every shape compiled once (dynamo's own counter agrees), a second call compiles nothing."""
    target, head, vq = image_parts
    eager = SpeculativeARImagePipeline(target, vq, eagle_head=head)
    pipe = SpeculativeARImagePipeline(target, vq, eagle_head=head).enable_compile(backend="eager")
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert torch.equal(run(pipe, do_sample=False, **method), run(eager, do_sample=False, **method))
    report = pipe.compile_report()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == sum(r["graphs"] for r in report.values())
    assert report["drafter"]["graphs"] == 2, report  # the accepted pairs and one step / tree-level shape
    assert torch.equal(run(pipe, seed=3, **method), run(eager, seed=3, **method))
    again = pipe.compile_report()
    for role, counts in again.items():
        assert counts["recompiles"] == 0 and counts["graphs"] == report[role]["graphs"], (role, report, again)
    assert again["drafter"]["calls"] > report["drafter"]["calls"]


def test_methods_sharing_a_pipeline_count_no_recompile(image_parts):
    """A chain then a tree on one pipeline: the head cache is allocated for each method's scratch, a new shape of the
    cache argument (`CompiledForward.signature` counts the tensors an object holds), not a recompile."""
    target, head, vq = image_parts
    pipe = SpeculativeARImagePipeline(target, vq, eagle_head=head).enable_compile(backend="eager")
    for method in (CHAIN, TREE):
        run(pipe, do_sample=False, **method)
    assert all(counts["recompiles"] == 0 for counts in pipe.compile_report().values()), pipe.compile_report()


@pytest.mark.slow
def test_inductor_eagle_tree_greedy_equal(image_parts):
    """The EAGLE-2 tree under CPU inductor (target: the tree width; head: pairs and a tree level): eager's tokens."""
    target, head, vq = image_parts
    pipe = SpeculativeARImagePipeline(target, vq, eagle_head=head).enable_compile()
    eager = SpeculativeARImagePipeline(target, vq, eagle_head=head)
    assert torch.equal(run(pipe, do_sample=False, **TREE), run(eager, do_sample=False, **TREE))
    assert all(counts["recompiles"] == 0 for counts in pipe.compile_report().values())


@pytest.fixture(scope="module")
def vlm():
    base, _ = quick_eagle_pipe()
    target = base.model
    vispec = VisionEagleHead.from_target(target, vision_policy="vispec", num_queries=3).load_text_head(base.eagle_head)
    return base, {"text": base.eagle_head, "vispec": vispec.eval()}, truncated_draft(target, 3)


VLM_CASES = {
    "text-chain": ("text", dict(drafter="eagle", tree_depth=3)),
    "text-tree": ("text", dict(drafter="eagle", tree_depth=3, tree_top_k=2, tree_nodes=4)),
    "vispec-tree": ("vispec", dict(drafter="eagle", tree_depth=3, tree_top_k=2, tree_nodes=4)),
    "lm-chain": (None, dict(drafter="model", num_draft_tokens=3)),
    "lm-tree": (None, dict(drafter="model", tree_depth=3, tree_top_k=2, tree_nodes=4)),
}


@pytest.mark.parametrize("case", VLM_CASES)
def test_vlm_drafters_no_recompile_greedy_equal(vlm, case):
    """The VLM's EAGLE heads (text, ViSpec) and draft LM, chains and trees, on LLaVA: greedy ids equal eager's,
    the drafter's forwards captured (2 shapes: accepted pairs / `[last, pending]` and a step / tree level), no
    recompile, and a second call compiles nothing."""
    base, heads, draft = vlm
    name, knobs = VLM_CASES[case]
    head = heads.get(name)
    made = [SpeculativeVLMPipeline(base.model, base.processor, draft_model=draft, eagle_head=head) for _ in range(2)]
    for p in made:
        p.set_progress_bar_config(disable=True)
    eager, pipe = made[0], made[1].enable_compile(backend="eager")
    kw = dict(images=images(1), prompt=prompts(1), max_new_tokens=12, output_type="ids", acceptance="greedy", **knobs)
    assert torch.equal(pipe(**kw).sequences, eager(**kw).sequences)
    report = pipe.compile_report()
    assert report["drafter"]["graphs"] == 2, report
    pipe(**kw)
    for role, counts in pipe.compile_report().items():
        assert counts["recompiles"] == 0 and counts["graphs"] == report[role]["graphs"], (role, report)


def test_captured_head_runs_a_prompt_eager(image_parts):
    """Calls over more pairs than a round accepts (a text prompt's pairs, once per call) bypass the graphs."""
    target, head, _ = image_parts

    class Never:  # a compiler whose graphs must not run
        def forward(self, role, model, fn=None):
            def graph(*args, **kwargs):
                raise AssertionError("a prompt-wide call went to the graph")

            return graph

    captured = CapturedHead(head, Never(), max_pairs=4)
    cache = head.setup_cache(1, 32)
    out = captured(torch.randn(1, 6, 32), torch.ones(1, 6, dtype=torch.long), target, cache, validate=False)
    assert out.shape == (1, 6, 32) and captured.config is head.config
