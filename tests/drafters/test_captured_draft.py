"""Captured drafting (`pipe.enable_compile(verify=True)`, `mmspec.decoding.captured_draft`): a drafter's whole round
-- an EAGLE head's chain or EAGLE-2 tree, a LlamaGen draft model's chain -- as one fullgraph graph.

* one graph, no break, for each round function (`_dynamo.explain`);
* greedy tokens, stats and trace equal eager's (batch 1, a ragged batch of 4 compacting, CFG), no recompile over
  whole generations, and a second call compiles nothing;
* the law: drafts drawn in the graph follow the `q_draft` it reports (chi-square of the joint law of a chain's first
  two drafts, both uniform sources), and the pipeline's sampled rows (per-row generators) keep each row independent
  of its batch;
* counted: with the graphs as launches, a round's drafting is a handful of eager ops (`DRAFT_OPS`), against 100-320
  with per-step graphs.
Graphs are traced with backend "eager" (no code generation): the graphs inductor would get.
"""

from types import SimpleNamespace

import factories
import pytest
import torch

from mmspec.decoding.captured_draft import CapturedDraft
from mmspec.decoding.compiled import Compiler
from mmspec.decoding.graph_uniforms import resolve_uniforms
from mmspec.decoding.guidance import Guidance
from mmspec.drafters import eagle, model
from mmspec.drafters.chain import draw_chain
from mmspec.eval.bench_profile import profile_captured
from mmspec.sampling import SamplingParams


V, GRID = 16, 4
METHODS = {
    "eagle-chain": dict(acceptance="exact", drafter="eagle", tree_depth=4),
    "eagle-tree": dict(acceptance="exact", drafter="eagle", tree_nodes=6, tree_depth=3, tree_top_k=2),
    "lantern": dict(acceptance="relaxed", drafter="eagle", tree_depth=4),
    "draft-model": dict(acceptance="exact", drafter="model", num_draft_tokens=4),
    "draft-model-cfg": dict(acceptance="exact", drafter="model", num_draft_tokens=3, guidance_scale=2.0),
    "sjd-pac": dict(acceptance="jacobi", jacobi_window=4, jacobi_tree_width=2, jacobi_tree_depth=3),
}
# method -> eager ops of a round's drafting at batch 1 with everything captured, a graph one launch (measured 10.8,
# 10.3, 10.9, 22.5, 22.5, 11.0: the chain's length, the uniforms' draw, the graph, the guidance sum's add, the
# proposal, and the drafter's commit after verification -- the next pairs, a draft model's cache roll-back; SJD-PAC's
# next window is filled in its proposal's graph, 33.6 eager at commit); per-step graphs leave the loop around them
# eager: 104-130 for the chains, 323 for the tree, 98 for SJD-PAC's eager proposal (`assets/bench/profile-zoo.json`
# before)
DRAFT_OPS = {
    "eagle-chain": 11,
    "eagle-tree": 11,
    "lantern": 11,
    "draft-model": 23,
    "draft-model-cfg": 23,
    "sjd-pac": 12,
}


@pytest.fixture(scope="module")
def parts():
    target, head = factories.tiny_gpt_with_head(V, GRID)
    draft = factories.tiny_gpt(5, vocab_size=V, num_classes=4, block_size=GRID**2, std=0.3)
    return target, head, draft, factories.tiny_vq(V)


def make_pipe(parts, method, compiler=None):
    from mmspec.pipelines import SpeculativeARImagePipeline

    target, head, draft, vq = parts
    model_draft = METHODS[method].get("drafter") == "model"
    pipe = SpeculativeARImagePipeline(target, vq, draft if model_draft else None, None if model_draft else head)
    pipe.set_progress_bar_config(disable=True)
    pipe._compiler = compiler
    return pipe


def run(pipe, method, labels, seed=0, per_row=False, **kw):
    gen = [torch.Generator().manual_seed(seed + i) for i in range(len(labels))] if per_row else None
    gen = gen or torch.Generator().manual_seed(seed)
    return pipe(class_labels=labels, generator=gen, output_type="tokens", **{**METHODS[method], **kw})


# LANTERN drafts with the EAGLE chain's round (its rule is the verification's) and the draft model's round is the CFG
# one's with one stream: their greedy runs would trace the same round functions again (150 s of the suite)
@pytest.mark.parametrize("method", [m for m in METHODS if m not in ("lantern", "draft-model")])
def test_greedy_tokens_equal_eager_and_nothing_recompiles(parts, method):
    """Greedy, batch 1 and a ragged batch of 4 (rows finish at different rounds and leave): eager's tokens, stats and
    trace, with the drafting captured (and the rest). The sampled calls of the same batches then compile every
    shape once, and with per-row generators a row's tokens are the same alone and inside the batch (its drafts' and
    its verification's uniforms come from its own generator, whatever the rest of the batch draws); a second call
    compiles nothing."""
    eager = make_pipe(parts, method)
    captured = make_pipe(parts, method, Compiler(backend="eager", verify=True))
    greedy, sampled = [], []
    for labels in ([1], [0, 1, 2, 3]):
        greedy.append([run(pipe, method, labels, do_sample=False) for pipe in (captured, eager)])
        factories.assert_decoded_alike(*greedy[-1])
        seed = 1 if len(labels) == 1 else 0  # the batch's row 1 draws from the generator of seed 0 + 1
        sampled.append(run(captured, method, labels, seed=seed, per_row=True).images)
    assert torch.equal(sampled[1][1], sampled[0][0])
    assert not torch.equal(sampled[0][0], greedy[0][0].images[0])  # the row is drawn, not its argmax
    report = captured.compile_report()
    # one graph call a round (each round's verification is captured too; SJD-PAC's last, cut short, is eager), no
    # per-step graphs
    assert report["draft"]["calls"] >= report["verify"]["calls"] > 0 and "drafter" not in report, report
    assert method == "sjd-pac" or report["draft"]["calls"] == report["verify"]["calls"], report
    assert report["draft"]["recompiles"] == 0 and report["draft"]["graphs"] == report["draft"]["shapes"], report
    run(captured, method, [0, 1, 2, 3], per_row=True)
    again = captured.compile_report()
    assert again["draft"]["graphs"] == report["draft"]["graphs"] and again["draft"]["recompiles"] == 0, again


def _round_args(parts, method):
    """A round function and its arguments at a fresh prefill (batch 2, sampled): what the drafter hands the graph."""
    target, head, draft, _ = parts
    guidance = Guidance(SamplingParams(temperature=1.0))
    uniforms = torch.rand(2, 4, dtype=torch.float64)
    if method == "draft-model":
        cache = draft.setup_cache(2, 32)
        draft.prefill(torch.tensor([1, 2]), cache)
        feed = torch.tensor([[3], [4]])
        return model.chain_round, (draft, cache, feed, None, guidance, uniforms, None, None), {"length": 4}
    cache = head.setup_cache(2, 32)
    hidden, ids = eagle.pad_pairs(torch.randn(2, 1, 32), torch.tensor([[3], [4]]), 5)
    pairs = (head, target, cache, hidden, ids, torch.ones(2, dtype=torch.long))
    if method == "eagle-tree":
        knobs = dict(depth=3, top_k=2, total=6, guidance_scale=None)
        return eagle.tree_round, (*pairs, None, None, None), knobs
    return eagle.chain_round, (*pairs, guidance, uniforms, None, None), {"length": 4}


@pytest.mark.parametrize("method", ["eagle-chain", "eagle-tree", "draft-model"])
def test_round_is_one_graph_without_breaks(parts, method):
    fn, args, kwargs = _round_args(parts, method)
    with torch.no_grad():
        explained = torch._dynamo.explain(fn)(*args, **kwargs)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def _toy_round(table, feed, guidance, uniforms, keys, round_index, *, length):
    """A chain over a fixed logit table (the next token's logits are the row of the last one fed)."""
    uniforms = resolve_uniforms(uniforms, keys, round_index, length)
    return draw_chain(lambda fed: table[fed[:, -1]], feed, length, guidance, uniforms)


@pytest.mark.parametrize("rng", ["generator", "philox"])
@pytest.mark.parametrize("per_row", [False, True])
def test_drafts_follow_the_reported_law(chi2_pvalue, rng, per_row):
    """Through the captured graph (`CapturedDraft`, both uniform sources, one generator or one per row): a chain's
    first two drafts follow `q_draft` jointly -- draft 1 ~ q(. | fed), draft 2 ~ q(. | draft 1) -- and the `q_draft`
    handed back is exactly the distribution each was drawn from. Fails when a draft is drawn on another draft's
    uniform (the two would be dependent) or from another distribution than the one reported."""
    n, vocab = 6000 if per_row else 20000, 5
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(1)) * 1.5
    guidance = Guidance(SamplingParams(temperature=1.0))
    generator = [torch.Generator().manual_seed(i) for i in range(n)] if per_row else torch.Generator().manual_seed(0)
    state = SimpleNamespace(ids=torch.arange(n), generator=generator)
    captured = CapturedDraft(Compiler(backend="eager", verify=True, rng=rng), n, "cpu")
    feed = torch.full((n, 1), 2)
    tokens, q, total = captured(_toy_round, state, 2, table, feed, guidance, length=2)
    law = torch.softmax(table.double(), -1)
    assert torch.allclose(q[:, 0].double(), law[feed[:, 0]], atol=1e-6)
    assert torch.allclose(q[:, 1].double(), law[tokens[:, 0]], atol=1e-6)
    assert torch.isclose(total, q.sum())
    joint = law[2][:, None] * law  # P(d1 = a, d2 = b)
    assert chi2_pvalue(tokens[:, 0] * vocab + tokens[:, 1], joint.flatten()) > 1e-3
    again, _, _ = captured(_toy_round, state, 2, table, feed, guidance, length=2)
    assert not torch.equal(again, tokens)  # the next call reads fresh uniforms (Philox: the next counter)


class _Runner:
    def __init__(self, pipe, method):
        self.pipes, self.method = {method: pipe}, method

    def call(self, method, batch, seed=0):
        return run(self.pipes[method], method, list(range(batch)), seed)


@pytest.mark.parametrize("method", list(METHODS))
def test_drafting_is_a_handful_of_ops_per_round(parts, method):
    """`mmspec bench profile`'s captured count (`profile_captured`: everything captured, a graph one launch): a round's
    drafting is at most `DRAFT_OPS` eager ops (per-step graphs: 100-320)."""
    pipe = make_pipe(parts, method)
    ops, reason = profile_captured(_Runner(pipe, method), method, 1)
    assert reason is None, reason
    assert ops["drafter"] <= DRAFT_OPS[method], ops


@pytest.mark.parametrize("rng", [None, "generator", "philox"], ids=["eager", "generator", "philox"])
def test_sjd_pac_levels_draw_independently(chi2_pvalue, rng):
    """SJD-PAC's proposal (`mmspec.drafters.jacobi_pac`), eager and as one graph (`proactive_round`, both uniform
    sources): with the same law and main draft at window positions 1 and 2, the main node's second child at level 1
    and at level 2 are independent without-replacement draws, jointly `q(a) q(c) / (1 - q(d))^2` (a level reading
    another level's uniforms makes them equal: broken once)."""
    from mmspec.decoding.state import SequenceState
    from mmspec.drafters.jacobi_pac import ProactiveJacobiDrafter

    vocab, n = 8, 40000
    q = torch.tensor([0.1, 0.3, 0.2, 0.15, 0.25, 0.0, 0.0, 0.0])
    drafter = ProactiveJacobiDrafter(vocab, window=3, width=3, depth=3, init="repeat", coupling=True)
    drafter.compiler = None if rng is None else Compiler(backend="eager", verify=True, rng=rng)
    state = SequenceState(torch.zeros(n, dtype=torch.long), 10, generator=torch.Generator().manual_seed(4))
    drafter.prefill(state, None)
    drafter.q_draft[:, :2], drafter.drafts[:, :2], drafter.num_carried[:] = q, 0, 2
    with torch.no_grad():
        tokens = drafter.propose(state).tokens
    assert (drafter.compiler is None) == (drafter.captured is None)
    a, c = tokens[:, 1], tokens[:, 4]  # level 1: nodes 0-2 (main first); level 2: the main node's children 3-5
    law = q.clone()
    law[0] = 0
    law = law / law.sum()
    assert chi2_pvalue(a * vocab + c, (law[:, None] * law[None, :]).flatten()) > 1e-3
