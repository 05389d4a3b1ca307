"""Captured drafting for transformers drafters (`pipe.enable_compile(verify=True)`, `mmspec.decoding.captured_draft`):
a VLM EAGLE head's whole chain or EAGLE-2 tree (text, vision-aware, EAGLE-3 heads, with or without a draft
vocabulary) and a draft LM's whole chain as one fullgraph graph, every forward in it on one attention window made on
the host before the graph (`mmspec.models.hf.target.round_window`).

* one graph, no break, for each round function (`_dynamo.explain`);
* greedy tokens equal eager's on a ragged batch with windows of 8 slots (so rounds cross window edges: a window that
  misses a slot the round writes fails -- broken once by leaving the drafted pairs out of it), no recompile;
* with per-row generators a sampled row's tokens are the same inside two batches of other prompts, whose graphs
  are on the same cache sizes (`captured_cache_slots`: prompts of other lengths reuse them);
* counted: a round's drafting is a handful of eager ops (`DRAFT_OPS`) against 180-245 with per-step graphs, and the
  target's forward, one graph whole (`mmspec.models.hf.target.scored_forward`: 1 graph, 0 breaks, chain and tree),
  `TARGET_OPS` against 37-43 with only its decoder captured (broken once).
The laws of the draws themselves are `draw_chain`'s, proven through the graph in `test_captured_draft.py`.
"""

import pytest
import torch
from vlm_fixtures import images, prompts, quick_eagle_pipe, random_vision_head

import mmspec.models.hf.target as hf_target
from mmspec.decoding.compiled import Compiler
from mmspec.decoding.guidance import Guidance
from mmspec.drafters import eagle, text_model
from mmspec.eval.bench_profile import profile_captured
from mmspec.models.hf.draft import truncated_draft
from mmspec.models.hf.eagle import TextEagleHead
from mmspec.models.hf.eagle3 import Eagle3Head
from mmspec.models.hf.target import HFTarget
from mmspec.pipelines.vlm import SpeculativeVLMPipeline
from mmspec.sampling import SamplingParams


CHAIN = dict(drafter="eagle", tree_depth=3)
TREE = dict(drafter="eagle", tree_depth=3, tree_top_k=2, tree_nodes=4)
CASES = {
    "text-chain": ("text", CHAIN),
    "frspec-tree": ("frspec", TREE),
    "vispec-chain": ("vispec", CHAIN),
    "eagle3-chain": ("eagle3", CHAIN),
    "lm-chain": ("lm", dict(drafter="model", num_draft_tokens=3)),
}
# case -> eager ops of a round's drafting at batch 1 with everything captured, a graph one launch (measured 7.7, 19.0: the
# chain's length, the window, the graph, the guidance sum, the proposal, the drafter's commit after verification);
# per-step graphs: 180-245 (`assets/bench/profile-zoo.json` before)
DRAFT_OPS = {"text-chain": 8, "lm-chain": 20}
TARGET_OPS = 3  # measured 1.7-2.0 (the items' padding, the window, the graph, the sum's add, the live cut)


@pytest.fixture(scope="module")
def parts():
    base, _ = quick_eagle_pipe()
    target = base.model
    text = base.eagle_head
    frspec = TextEagleHead(**{**{k: v for k, v in text.config.items() if not k.startswith("_")},
                              "draft_vocab_size": 40})  # fmt: skip
    frspec.load_state_dict({k: v for k, v in text.state_dict().items() if k != "draft_vocab"}, strict=False)
    frspec.set_draft_vocab(torch.arange(4, 44)).eval()
    eagle3 = Eagle3Head.from_target(target, aux_layers=(1, 2, 3), draft_vocab_size=40, initializer_range=0.05)
    eagle3.set_draft_vocab(torch.arange(4, 44)).init_from_target(target)
    heads = {"text": text, "frspec": frspec, "vispec": random_vision_head(text, target, "vispec"),
             "eagle3": eagle3.eval(), "lm": None}  # fmt: skip
    return base, heads, truncated_draft(target, 3)


def make_pipe(parts, case, compiler=None):
    base, heads, draft = parts
    name = CASES[case][0]
    pipe = SpeculativeVLMPipeline(base.model, base.processor, draft_model=draft if name == "lm" else None,
                                  eagle_head=heads[name])  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    pipe._compiler = compiler
    return pipe


def run(pipe, case, n, seed=0, per_row=False, **kw):
    gen = (
        [torch.Generator().manual_seed(seed + i) for i in range(n)] if per_row else torch.Generator().manual_seed(seed)
    )
    return pipe(images=images(n), prompt=prompts(n), max_new_tokens=12, output_type="ids", generator=gen,
                **CASES[case][1], **kw)  # fmt: skip


@pytest.mark.parametrize("case", ["text-chain", "frspec-tree", "lm-chain"])
def test_round_is_one_graph_without_breaks(parts, case):
    """The round functions traced as the drafter hands them over (batch 2, sampled, a window of the head's or the
    draft's cache): 1 graph, 0 breaks."""
    base, heads, draft = parts
    guidance = Guidance(SamplingParams(temperature=1.0))
    uniforms = torch.rand(2, 3, dtype=torch.float64)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    if case == "lm-chain":
        lm = HFTarget(draft, guidance, source="draft")
        lm.prefill(ids, torch.tensor([4, 3]), 16, 5)
        fn, args = text_model.chain_round, (lm, ids[:, :2], guidance, uniforms, None, None)
        kwargs = dict(length=3, window=lm.round_window(4))
    else:
        head = heads[CASES[case][0]]
        cache = head.setup_cache(2, 40)
        dim = head.config.hidden_size
        hidden, pairs = eagle.pad_pairs(torch.randn(2, 1, dim), ids[:, :1], 4)
        args = (head, base.model, cache, hidden, pairs, torch.ones(2, dtype=torch.long))
        head.prepare_round(base.model)
        if case == "text-chain":
            fn, args, kwargs = eagle.chain_round, (*args, guidance, uniforms, None, None), dict(length=3)
        else:
            fn, args = eagle.tree_round, (*args, None, None, None)
            kwargs = dict(depth=3, top_k=2, total=4, guidance_scale=None)
        kwargs["window"] = hf_target.round_window(cache, 8)
    with torch.no_grad():
        explained = torch._dynamo.explain(fn)(*args, **kwargs)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_eager_across_window_edges(parts, case, monkeypatch):
    """Greedy, a ragged batch of 3 (rows finish and leave), windows of 8 slots: eager's tokens, with every round but
    the first (a text prompt's pairs / the draft's `[pending]`, once per call) one "draft" graph; every shape
    compiled once."""
    monkeypatch.setattr(hf_target, "WINDOW_BUCKET", 8)
    eager = make_pipe(parts, case)
    captured = make_pipe(parts, case, Compiler(backend="eager", verify=True))
    got, want = (run(pipe, case, 3, do_sample=False).sequences for pipe in (captured, eager))
    assert torch.equal(got, want)
    report = captured.compile_report()
    assert report["draft"]["calls"] >= report["verify"]["calls"] - 3 > 0, report
    assert all(r["recompiles"] == 0 for r in report.values()), report


@pytest.mark.parametrize("case", ["lm-chain", "text-chain"])
def test_per_row_generators_keep_rows_batch_independent(parts, case):
    """Everything captured, sampled, per-row generators: a row's tokens are the same inside two batches that differ
    in its position and its neighbours (the draft LM's chain and a text EAGLE head's; `test_captured_draft.py`
    also compares a row alone). Both batches are 3 rows and their prompts differ in length: the caches' sizes are
    on buckets (`captured_cache_slots`), so the second call's graphs are on the first's cache sizes (every graph
    was traced again when a cache was sized to its prompt: broken once for the target and the draft LM, once for
    the head)."""
    pipe = make_pipe(parts, case, Compiler(backend="eager", verify=True))
    pics, texts = images(4), prompts(4)

    def sampled(rows, seeds):
        return pipe(images=[pics[r] for r in rows], prompt=[texts[r] for r in rows], max_new_tokens=12,
                    output_type="ids", generator=[torch.Generator().manual_seed(s) for s in seeds], do_sample=True,
                    temperature=0.8, **CASES[case][1]).sequences  # fmt: skip

    first = sampled([0, 1, 2], [5, 6, 7])
    sizes = cache_sizes(pipe)
    second = sampled([1, 3, 2], [6, 8, 7])  # row 1 first, beside another prompt (of another length)
    assert cache_sizes(pipe) == sizes, sizes  # new graphs only for new row buckets (rows that finish apart)
    assert len(texts[3].split()) != len(texts[0].split())
    n = min(first.shape[1], second.shape[1])
    assert torch.equal(first[1, :n], second[0, :n])
    assert not torch.equal(first[0, :n], second[1, :n])  # the other rows do differ


def cache_sizes(pipe) -> set:
    """The slot counts of every cache the pipeline's graphs were traced with (`key_valid [rows, slots]` in each
    shape's signature, `mmspec.decoding.compiled.CompiledForward.signature`)."""
    sizes = set()

    def walk(value):
        if isinstance(value, tuple):
            if len(value) == 2 and value[0] == "key_valid":
                sizes.add(value[1][0][1])
            else:
                for item in value:
                    walk(item)

    for forward in pipe._compiler.forwards.values():
        for shape in forward.shapes:
            walk(shape)
    return sizes


class _Runner:
    def __init__(self, pipe, case):
        self.pipes, self.case = {case: pipe}, case

    def call(self, method, batch, seed=0):
        return run(self.pipes[method], method, batch, seed, do_sample=False)


@pytest.mark.parametrize("case", list(DRAFT_OPS))
def test_drafting_is_a_handful_of_ops_per_round(parts, case):
    """`mmspec bench profile`'s captured count (everything captured, a graph one launch): a round's drafting is at
    most `DRAFT_OPS` eager ops, and the target's forward -- one graph (`scored_forward`) -- `TARGET_OPS`."""
    ops, reason = profile_captured(_Runner(make_pipe(parts, case), case), case, 1)
    assert reason is None, reason
    assert ops["drafter"] <= DRAFT_OPS[case] and ops["target"] <= TARGET_OPS, ops


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_target_forward_is_one_graph_without_breaks(parts, tree):
    """`HFTarget.forward` as the captured round runs it (`scored_forward`: positions, slots and mask -- a tree's
    ancestry in a fixed number of ops --, the decoder on the round's window, the output head and the processing):
    1 graph, 0 breaks."""
    from mmspec.models.hf.target import scored_forward

    base, _, _ = parts
    guidance = Guidance(SamplingParams(temperature=1.0))
    target = HFTarget(base.model, guidance)
    target.prefill(torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]), torch.tensor([4, 3]), 16, 5)
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    parents = torch.tensor([[-1, 0, 0], [-1, -1, 1]]) if tree else None
    with torch.no_grad():
        explained = torch._dynamo.explain(scored_forward)(target, target.cache, guidance, tokens, parents, width=4,
                                                          window=target.round_window(4))  # fmt: skip
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
