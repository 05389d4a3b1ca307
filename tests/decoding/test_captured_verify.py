"""Captured verification (`pipe.enable_compile(verify=True)`, `mmspec.decoding.captured_verify`): a chain round's
verification (or plain AR's draw) and its emit as one fullgraph graph on uniforms drawn eagerly first.

* greedy tokens equal eager's (EAGLE chain and plain, batch 1 and a ragged batch of 4 that compacts onto row buckets;
  the VLM pipeline's ragged batch with rows ending at EOS);
* the law: chi-square of the first two emitted tokens through the captured graph (ragged drafts, a proposal narrower
  than the call's width, so the padding and the uniforms' layout are exercised);
* counted: `_dynamo.explain` 1 graph / 0 breaks per rule, 0 recompiles over whole generations, engine ops per round
  outside the graphs (`ENGINE_OPS_CAPTURED`, exact bounds) and host reads within the eager budgets;
* per-row generators: a row's tokens do not depend on the rest of its batch;
* `rng="philox"` (uniforms made in the graph, `mmspec.philox`): Random123's known answers, uniform and independent
  draws, the same law by chi-square, batch independence, reproducible from the generators, and no draw outside the
  graph: a round's eager ops do not grow with the rows of a per-row generator list.
Graphs are traced with backend "eager" (no code generation): fast, and the same graphs inductor would get.
"""

import contextlib
import statistics

import factories
import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

from mmspec.counting import HostReads, OpCount
from mmspec.decoding.captured_verify import CapturedVerify, captured_round
from mmspec.decoding.compiled import Compiler
from mmspec.decoding.drafter import Proposal
from mmspec.decoding.state import SequenceState
from mmspec.eval.bench_profile import profile_call
from mmspec.verify import Exact, Grouped, Lantern


V, GRID = 16, 4
METHODS = {
    "eagle-chain": dict(acceptance="exact", drafter="eagle", tree_depth=4),
    "plain": dict(acceptance="none"),
    "sjd": dict(acceptance="jacobi", jacobi_window=4, coupling=False),
    "scd": dict(acceptance="jacobi", jacobi_window=4),
    "eagle-tree": dict(acceptance="exact", drafter="eagle", tree_nodes=6, tree_depth=3, tree_top_k=2),
    "sjd-pac": dict(acceptance="jacobi", jacobi_window=4, jacobi_tree_width=2, jacobi_tree_depth=3),
}
SAMPLED = {"gsd": dict(acceptance="grouped")}  # a sampling rule: no greedy form
# method -> eager ops of a round's captured verification + emit at batch 1 (eager: 59 + 15 for the chain, 13 + 15 for
# plain): at a full row / width bucket its one `rand` and the graph's launch (2); a chain narrower than the call's
# width near the image's end adds its padding (tokens, p_target, q_draft: 3) and the cut back (3; a Jacobi window's
# next drafts and their laws: 2 more); the first round widens the state's buffer once (2). GSD's default window
# (32) is wider than this 16-token image: every round is padded
VERIFY_OPS = {"eagle-chain": 8, "plain": 4, "sjd": 12, "scd": 12, "gsd": 12, "eagle-tree": 12, "sjd-pac": 4}
# method -> the engine's other ops per round (the loop's compaction read, the cache commit, the pending tokens, the
# stats), as measured (25.4, 27.3, 25.7 for the Jacobi windows, 57.4 for the tree, whose root prepending and
# path commit stay eager, 57.7 for SJD-PAC: 93.5 while its last rounds, their window cut short by the image's end,
# verified eagerly, at batch 1) + slack (eager loop: 101.6 for
# the chain in all, 131.9 for SJD, 269.5 for GSD, 227.9 for the tree, 404.5 for SJD-PAC:
# tests/decoding/test_engine_ops.py)
ENGINE_OPS_CAPTURED = {
    "eagle-chain": 27,
    "plain": 29,
    "sjd": 27,
    "scd": 27,
    "gsd": 27,
    "eagle-tree": 60,
    "sjd-pac": 60,
}


@pytest.fixture(scope="module")
def parts():
    return (*factories.tiny_gpt_with_head(V, GRID), factories.tiny_vq(V))


class VerifyOnly(Compiler):
    """A compiler that captures the verification only (the forwards run eagerly, through their captured padding):
    the graph under test, quick to trace. One test runs everything captured (`test_full_capture_greedy`)."""

    def forward(self, role, model, fn=None, device=None):
        return super().forward(role, model, fn, device) if role == "verify" else (model if fn is None else fn)


def make_pipe(parts, compiler=None):
    from mmspec.pipelines import SpeculativeARImagePipeline

    target, head, vq = parts
    pipe = SpeculativeARImagePipeline(target, vq, None, head)
    pipe.set_progress_bar_config(disable=True)
    pipe._compiler = compiler
    return pipe


@pytest.fixture(scope="module")
def captured(parts):
    """One pipeline with verification captured, shared: each graph is traced once for the module."""
    return make_pipe(parts, VerifyOnly(backend="eager", verify=True))


@pytest.fixture(scope="module")
def captured_philox(parts):
    """The same with the captured verification's uniforms made in its graph (`rng="philox"`)."""
    return make_pipe(parts, VerifyOnly(backend="eager", verify=True, rng="philox"))


def run(pipe, method, labels, seed=0, **kw):
    gen = [torch.Generator().manual_seed(seed + i) for i in range(len(labels))] if kw.pop("per_row", False) else None
    gen = gen or torch.Generator().manual_seed(seed)
    return pipe(class_labels=labels, generator=gen, output_type="tokens", **{**METHODS, **SAMPLED}[method], **kw)


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_tokens_equal_eager_and_nothing_recompiles(parts, captured, method):
    """Greedy, batch 1 and a ragged batch of 4 (rows finish at different rounds: 3 rows left run on a bucket of 4,
    then 2, 1): eager's tokens, stats and trace. With the sampled calls (per-row generators) of the same batches:
    every verify graph was compiled once per shape, dynamo's counters agree, and a second call compiles nothing."""
    eager = make_pipe(parts)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for labels in ([1], [0, 1, 2, 3]):
        # the round's log and counts, written by the graph's emit, are eager's too
        factories.assert_decoded_alike(*(run(pipe, method, labels, do_sample=False) for pipe in (captured, eager)))
        run(captured, method, labels, per_row=True)
    report = captured.compile_report()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
    assert report["verify"]["calls"] > 0 and graphs <= report["verify"]["graphs"]
    run(captured, method, [1], per_row=True)
    again = captured.compile_report()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == graphs  # the second call: none
    assert again["verify"]["recompiles"] == 0 and again["verify"]["graphs"] == report["verify"]["graphs"], again
    rows = {
        sig[2][0][0] for (role, _), f in captured.compiler.forwards.items() if role == "verify" for sig in f.shapes
    }
    assert rows <= {4, 2, 1} and len(rows) > 1, rows  # the verify graph follows the row buckets


def test_full_capture_greedy(parts):
    """Everything captured (`enable_compile(backend="eager", verify=True)`: target, the EAGLE head's whole round of
    drafting (`mmspec.decoding.captured_draft`), verification): eager's greedy tokens, one graph per shape, no
    recompile."""
    pipe = make_pipe(parts).enable_compile(backend="eager", verify=True)
    want = run(make_pipe(parts), "eagle-chain", [1], do_sample=False).images
    assert torch.equal(run(pipe, "eagle-chain", [1], do_sample=False).images, want)
    report = pipe.compile_report()
    assert set(report) == {"target", "draft", "verify"}, report
    assert all(r["recompiles"] == 0 and r["graphs"] == r["shapes"] for r in report.values()), report
    assert report["verify"]["graphs"] == 1, report


RULES = {"exact": Exact(), "relaxed": Lantern(neighbours=torch.arange(V).roll(1)[:, None], delta=0.2),
         "grouped": Grouped(embeddings=torch.randn(V, 4, generator=torch.Generator().manual_seed(0)))}  # fmt: skip


@pytest.mark.parametrize("rule, greedy, eos", [("exact", False, None), ("exact", True, [2, 5]), ("relaxed", False, [2]),
                                             ("relaxed", True, None), ("grouped", False, None)])  # fmt: skip
def test_verification_is_one_graph_without_breaks(rule, greedy, eos):
    """`_dynamo.explain` of the traced round (verification + emit, with and without EOS ids): 1 graph, 0 breaks."""
    gen = torch.Generator().manual_seed(0)
    p = torch.rand(3, 4, V, generator=gen).softmax(-1)
    q = torch.rand(3, 3, V, generator=gen).softmax(-1)
    tokens, lengths = torch.randint(0, V, (3, 3), generator=gen), torch.tensor([3, 1, 0])
    uniforms = None if greedy else torch.rand(3, 4, generator=gen, dtype=torch.float64)
    held = torch.full((3, 10 + 4), -1), torch.tensor([1, 3, 9]), torch.zeros(3, dtype=torch.bool)  # a state's
    eos = None if eos is None else torch.tensor(eos)
    explained = torch._dynamo.explain(captured_round)(RULES[rule], tokens, p, q, lengths, uniforms, *held, 10, eos)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("rng", ["generator", "philox"])
def test_captured_chain_law(chi2_pvalue, rng):
    """Monte Carlo through `CapturedVerify` (the graph, its padding and its uniforms): 200k independent rows, 0-2
    valid drafts of 2 per row against a call width of 3; the first emitted token follows p1 and the first two
    p1(y1) p2(y2 | y1) (chi-square p > 1e-4, fixed seeds), as `test_verify_exact`'s eager test."""
    n, gen = 200_000, torch.Generator().manual_seed(10)
    law = torch.Generator().manual_seed(2)
    p1, p2, p3 = (torch.rand(shape, generator=law).pow(2) for shape in ((V,), (V, V), (V, V, V)))
    q1, q2 = (torch.rand(shape, generator=law).pow(2) for shape in ((V,), (V, V)))
    p1, p2, p3, q1, q2 = (x / x.sum(-1, keepdim=True) for x in (p1, p2, p3, q1, q2))

    def draw(probs):
        return torch.multinomial(probs, 1, generator=gen).squeeze(-1)

    x1 = draw(q1.expand(n, V))
    x2 = draw(q2[x1])
    num_draft = torch.randint(0, 3, (n,), generator=gen)
    drafts = torch.where(torch.arange(2) < num_draft[:, None], torch.stack([x1, x2], 1), -1)
    p_target = torch.stack([p1.expand(n, V), p2[x1], p3[x1, x2]], dim=1)
    q_draft = torch.stack([q1.expand(n, V), q2[x1]], dim=1)
    verify = CapturedVerify(Compiler(backend="eager", verify=True, rng=rng), n, 3, "cpu")
    state = SequenceState(torch.zeros(n, dtype=torch.long), 8, generator=gen)
    res, num, _ = verify(Exact(), Proposal(drafts, num_draft, q_draft), p_target, state, greedy=False)
    assert res.tokens.shape == (n, 3) and (res.num_accepted <= num_draft).all() and torch.equal(num, res.num_emitted)
    assert torch.equal(state.tokens[:, 1:4], torch.where(res.tokens >= 0, res.tokens, -1))  # appended after token 0
    y1 = res.tokens[:, 0]
    y2 = torch.where(res.num_accepted >= 1, res.tokens[:, 1], draw(p2[y1]))  # next round if rejected
    assert chi2_pvalue(y1, p1) > 1e-4
    assert chi2_pvalue(y1 * V + y2, (p1[:, None] * p2).flatten()) > 1e-4


@pytest.mark.parametrize("rule", ["exact", "grouped"])
@pytest.mark.parametrize("coupling", [False, True])
def test_jacobi_verification_is_one_graph_without_breaks(rule, coupling):
    """A Jacobi window's round (verification, SJD's or SCD's re-draft, the carried window, the emit): 1 graph, 0
    breaks, under the exact rule and GSD's. Traced by `fullgraph` compile with a counting backend rather than
    `_dynamo.explain`, which resets dynamo's caches under the module's shared pipelines."""
    gen = torch.Generator().manual_seed(0)
    p = torch.rand(3, 4, V, generator=gen).softmax(-1)
    q = torch.rand(3, 3, V, generator=gen).softmax(-1)
    tokens, lengths = torch.randint(0, V, (3, 3), generator=gen), torch.tensor([3, 1, 2])
    uniforms = torch.rand(3, 3 * 3 + 2, generator=gen, dtype=torch.float64)
    held = torch.full((3, 10 + 4), -1), torch.tensor([1, 3, 9]), torch.zeros(3, dtype=torch.bool)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    traced = torch.compile(captured_round, fullgraph=True, dynamic=False, backend=backend)  # a break raises
    want = captured_round(RULES[rule], tokens, p, q, lengths, uniforms, *held, 10, None, jacobi=coupling)
    got = traced(RULES[rule], tokens, p, q, lengths, uniforms, *held, 10, None, jacobi=coupling)
    assert len(graphs) == 1 and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("rng", ["generator", "philox"])
@pytest.mark.parametrize("coupling", [False, True])
def test_captured_jacobi_law(chi2_pvalue, rng, coupling):
    """Monte Carlo through `CapturedVerify` for a Jacobi window (SJD, and SCD's coupled re-draft): 200k rows, 1-2
    stale drafts of 2 per row (d1 ~ q1, d2 ~ q2) against a call width of 3. The emitted tokens follow p1, then p2
    (chi-square p > 1e-4); a row that rejected d1 carries the re-drafts of positions 2 and 3, which follow p2 and
    p3 (their laws handed on as the next q); and the re-draft of position 2 repeats d2 at the coupling's rate
    sum min(p2, q2) with SCD, at sum p2 q2 without (5 standard deviations)."""
    n, gen = 200_000, torch.Generator().manual_seed(11)
    law = torch.Generator().manual_seed(3)
    p1, p2, p3, q1, q2 = (torch.rand(V, generator=law).pow(2) for _ in range(5))
    p1, p2, p3, q1, q2 = (x / x.sum() for x in (p1, p2, p3, q1, q2))

    def draw(probs):
        return torch.multinomial(probs, n, replacement=True, generator=gen)

    d1, d2 = draw(q1), draw(q2)
    num_draft = torch.randint(1, 3, (n,), generator=gen)
    drafts = torch.where(torch.arange(2) < num_draft[:, None], torch.stack([d1, d2], 1), -1)
    p_target = torch.stack([p1, p2, p3]).expand(n, 3, V)
    q_draft = torch.stack([q1, q2]).expand(n, 2, V)
    verify = CapturedVerify(Compiler(backend="eager", verify=True, rng=rng), n, 3, "cpu")
    state = SequenceState(torch.zeros(n, dtype=torch.long), 8, generator=gen)
    proposal = Proposal(drafts, num_draft, q_draft, jacobi_coupling=coupling)
    res, num, _ = verify(Exact(), proposal, p_target, state, greedy=False)
    assert res.next_drafts.shape == (n, 2) and res.next_q.shape == (n, 2, V)
    assert torch.equal(res.num_carried, torch.where(res.num_accepted < num_draft, num_draft - res.num_accepted, 0))
    y1 = res.tokens[:, 0]
    y2 = torch.where(res.num_accepted >= 1, res.tokens[:, 1], draw(p2))  # next round's if d1 was rejected
    assert chi2_pvalue(y1, p1) > 1e-4
    assert chi2_pvalue(y1 * V + y2, (p1[:, None] * p2).flatten()) > 1e-4
    rows = (res.num_accepted == 0) & (num_draft == 2)  # rejected d1: carries the re-drafts of positions 2 and 3
    carried = res.next_drafts[rows]
    assert (res.num_carried[rows] == 2).all() and chi2_pvalue(carried[:, 0], p2) > 1e-4
    assert chi2_pvalue(carried[:, 1], p3) > 1e-4
    assert torch.equal(res.next_q[rows], torch.stack([p2, p3]).expand(int(rows.sum()), 2, V).to(res.next_q.dtype))
    repeat = (carried[:, 0] == d2[rows]).double().mean().item()
    want = (torch.minimum(p2, q2).sum() if coupling else (p2 * q2).sum()).item()
    assert abs(repeat - want) < 5 * (want * (1 - want) / int(rows.sum())) ** 0.5, (repeat, want)


@pytest.mark.parametrize("rng", ["generator", "philox"])
def test_captured_tree_law(chi2_pvalue, rng):
    """Monte Carlo through `CapturedVerify` for EAGLE-2-style trees (deterministic children, exact rule): 200k rows
    of ragged trees (three shapes per-row, a chain of depth 5 among them, random absent nodes with their subtrees,
    duplicate siblings possible) of 5 nodes against a call width of 7 (padded with absent nodes), bounds (5, 3). The
    first emitted token follows p1 and the first two p1(y1) p2(y2 | y1) (chi-square p > 1e-4), as
    tests/verify/test_verify_tree.py's eager test; absent nodes are never accepted."""
    n, v, gen = 200_000, 5, torch.Generator().manual_seed(31)
    law = torch.Generator().manual_seed(5)
    p1, p2, p3 = (torch.rand(shape, generator=law).pow(3) for shape in ((v,), (v, v), (v, v, v)))
    p1, p2, p3 = (x / x.sum(-1, keepdim=True) for x in (p1, p2, p3))
    shapes = torch.tensor([[-1, -1, -1, 0, 0], [-1, 0, 1, 2, 3], [-1, -1, 0, 0, 1]])
    parents = shapes[torch.randint(0, 3, (n,), generator=gen)]
    tok = torch.randint(0, v, (n, 5), generator=gen)
    absent = torch.rand(n, 5, generator=gen) < 0.2
    for i in range(5):  # absent nodes take their subtree with them
        par = parents[:, i]
        absent[:, i] |= (par >= 0) & absent.gather(1, par.clamp(min=0)[:, None]).squeeze(1)
    tok = torch.where(absent, -1, tok)
    first = torch.zeros(n, 5, dtype=torch.long)  # the path's first token: p(. | path) = p2 at depth 1, p3 below
    nodes = []
    for i in range(5):
        par, t = parents[:, i], tok[:, i].clamp(min=0)
        first[:, i] = torch.where(par < 0, t, first.gather(1, par.clamp(min=0)[:, None]).squeeze(1))
        nodes.append(torch.where((par < 0)[:, None], p2[t], p3[first[:, i], t]))
    p_target = torch.stack([p1.expand(n, v)] + nodes, dim=1)
    verify = CapturedVerify(Compiler(backend="eager", verify=True, rng=rng), n, 7, "cpu")
    state = SequenceState(torch.zeros(n, dtype=torch.long), 8, generator=gen)
    res, num, _ = verify(
        Exact(), Proposal(tok, (tok >= 0).sum(1), parents=parents, bounds=(5, 3)), p_target, state, greedy=False
    )
    assert res.tokens.shape == (n, 6) and res.path.shape == (n, 6) and res.accept_mask.shape == (n, 5)
    assert torch.equal(num, res.num_emitted) and not res.accept_mask[absent].any()
    y1 = res.tokens[:, 0]
    y2 = torch.where(res.num_accepted >= 1, res.tokens[:, 1], torch.multinomial(p2[y1], 1, generator=gen)[:, 0])
    assert chi2_pvalue(y1, p1) > 1e-4
    assert chi2_pvalue(y1 * v + y2, (p1[:, None] * p2).flatten()) > 1e-4


def test_jacobi_windows_keep_rows_batch_independent(captured, captured_philox):
    """Sampled SCD with per-row generators, captured: row 2 of a batch of 3 is the same image alone."""
    for pipe in (captured, captured_philox):
        batch = run(pipe, "scd", [0, 1, 2], per_row=True).images
        assert torch.equal(batch[2], run(pipe, "scd", [2], seed=2, per_row=True).images[0])


@pytest.mark.parametrize("rng", ["generator", "philox"])
def test_per_row_generators_keep_rows_batch_independent(captured, captured_philox, rng):
    """Sampled EAGLE chain, per-row generators: row 2 of a batch of 3 is the same image alone (its draws come from
    its own generator only, the same number each round; philox: its own key, the round's counter)."""
    captured = captured_philox if rng == "philox" else captured
    batch = run(captured, "eagle-chain", [0, 1, 2], per_row=True).images
    alone = run(captured, "eagle-chain", [2], seed=2, per_row=True).images
    assert torch.equal(batch[2], alone[0])
    plain = run(captured, "plain", [0, 1, 2], per_row=True).images
    assert torch.equal(plain[2], run(captured, "plain", [2], seed=2, per_row=True).images[0])


def _counters(kind=OpCount):
    return [m for m in _get_current_dispatch_mode_stack() if isinstance(m, kind)]


@contextlib.contextmanager
def graphs_as_launches(pipe, monkeypatch):
    """Run every captured graph of `pipe` outside the dispatch modes (dynamo refuses to trace under one; a graph is
    one launch, counted under phase "graph" of the active `OpCount`), and count `CapturedVerify` calls (the graph's
    launch included) under phase "verify". Yields the lists of each verification's eager ops and host reads."""
    patched, verify_ops, verify_reads = [], [], []
    for forward in pipe.compiler.forwards.values():
        compiled = forward._compiled

        def launch(*args, _compiled=compiled, **kwargs):
            with _disable_current_modes():
                out = _compiled(*args, **kwargs)
            for counter in _counters():
                counter.by_phase[counter._phases[-1] if counter._phases[-1] == "verify" else "graph"] += 1
            return out

        forward._compiled = launch
        patched.append((forward, compiled))
    call = CapturedVerify.__call__

    def counted(self, *args, **kwargs):
        reads = _counters(HostReads)
        before_reads = [r.count for r in reads]
        if not _counters():  # not counting ops (profile_call's warm-up call, a call counting host reads only)
            out = call(self, *args, **kwargs)
        else:
            counter = _counters()[-1]
            before = counter.by_phase["verify"]
            with counter.phase("verify"):
                out = call(self, *args, **kwargs)
            verify_ops.append(counter.by_phase["verify"] - before)
        verify_reads.extend(r.count - b for r, b in zip(reads, before_reads))
        return out

    monkeypatch.setattr(CapturedVerify, "__call__", counted)
    try:
        yield verify_ops, verify_reads
    finally:
        for forward, compiled in patched:
            forward._compiled = compiled


class _Run:
    def __init__(self, pipe):
        self.pipe = pipe

    def call(self, method, batch, seed=0):
        return run(self.pipe, method, list(range(batch)), seed)


@pytest.mark.parametrize("method", [*METHODS, *SAMPLED])
def test_engine_ops_and_host_reads_per_round(captured, method, monkeypatch):
    """`profile_call`'s count with the graphs as launches: a round's verification and emit are `VERIFY_OPS` eager
    ops (its draw and its graph's launch; eager: 74 for the chain, 28 for plain), the rest of the engine
    `ENGINE_OPS_CAPTURED` per round; the call keeps test_host_reads' budget, and the verification reads nothing, also on a ragged batch of
    per-row generators (eager, the coins drawn with per-row counts read them once per chain round)."""
    with torch.no_grad():
        run(captured, method, [0, 1, 2], per_row=True)  # every graph of the shapes below exists
        with graphs_as_launches(captured, monkeypatch) as (verify_ops, verify_reads):
            row = profile_call(_Run(captured), method, 1)
            counted_ops = list(verify_ops)
            with HostReads():
                out = run(captured, method, [0, 1, 2], per_row=True)
    engine, rounds = row["ops_per_round"]["engine"], row["rounds"]
    # every round verifies captured (SJD-PAC's too: its captured proposal keeps the whole window to the image's end)
    assert rounds >= 2 and len(counted_ops) == rounds, (rounds, counted_ops)
    assert max(counted_ops) <= VERIFY_OPS[method], f"{method}: {counted_ops}"
    assert method in SAMPLED or counted_ops.count(2) > rounds // 2, f"{method}: {counted_ops}"  # most rounds: 2
    assert engine <= ENGINE_OPS_CAPTURED[method], f"{method}: {engine:.1f} engine ops per round besides verification"
    # test_host_reads' budget of these methods: one read per round, 8 per call outside the rounds
    assert row["host_reads_per_call"] <= rounds + 8, row["host_reads_where"]
    # every captured round counted
    assert len(verify_reads) >= rounds + max(out.stats.rounds) and not any(verify_reads), verify_reads


def test_vlm_ragged_batch_with_eos_equals_eager():
    """The VLM pipeline (tiny LLaVA, seed 1: rows 0 and 1 end at EOS early, so the graph's EOS cut and compaction are
    exercised), greedy, a ragged batch of 4: the draft LM's chain and its EAGLE-2 tree give eager's ids, no
    recompile."""
    from vlm_fixtures import images, prompts, tiny_llava, tiny_processor

    from mmspec.models.hf.draft import truncated_draft
    from mmspec.pipelines.vlm import SpeculativeVLMPipeline

    target = tiny_llava(4, seed=1)
    pipe = SpeculativeVLMPipeline(target, tiny_processor(), draft_model=truncated_draft(target, 3))
    pipe.set_progress_bar_config(disable=True)
    kw = dict(images=images(4), prompt=prompts(4), max_new_tokens=30, output_type="ids", do_sample=False)
    tree = dict(tree_depth=3, tree_top_k=2, tree_nodes=6)
    want = pipe(**kw, acceptance="exact", drafter="model").sequences
    want_tree = pipe(**kw, acceptance="exact", drafter="model", **tree).sequences
    assert torch.equal(want_tree, want)
    pipe._compiler = VerifyOnly(backend="eager", verify=True)
    assert torch.equal(pipe(**kw, acceptance="exact", drafter="model").sequences, want)
    assert torch.equal(pipe(**kw, acceptance="exact", drafter="model", **tree).sequences, want)
    assert pipe.compile_report()["verify"]["recompiles"] == 0
    assert (want[:2] == -1).any(1).all() and (want[2:] >= 0).all()  # rows 0 and 1 ended early


PHILOX_KAT = [  # Random123's known answers for Philox4x32-10 (its tests/kat_vectors): counter, key, output
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]  # fmt: skip


def test_philox_known_answers_and_uniform_independent_draws(chi2_pvalue):
    from mmspec.philox import philox4x32, philox_uniforms

    for counter, key, want in PHILOX_KAT:
        assert philox4x32(torch.tensor(counter), torch.tensor(key)).tolist() == list(want)
    keys = torch.tensor([[1, 2], [1, 3], [0xFFFFFFFF, 0]])
    u = philox_uniforms(keys, torch.tensor(7), 40_000)  # [3, 40k]
    assert u.dtype == torch.float64 and (u >= 0).all() and (u < 1).all()
    uniform = torch.full((20,), 1 / 20)
    for row in u:  # each row uniform, consecutive pairs independent
        assert chi2_pvalue((row * 20).long(), uniform) > 1e-4
        pairs = (row[:-1:2] * 10).long() * 10 + (row[1::2] * 10).long()
        assert chi2_pvalue(pairs, torch.full((100,), 1 / 100)) > 1e-4
    across = (u[0] * 10).long() * 10 + (u[1] * 10).long()  # keys one bit apart: independent streams
    assert chi2_pvalue(across, torch.full((100,), 1 / 100)) > 1e-4
    nxt = philox_uniforms(keys, torch.tensor(8), 40_000)  # the next round's counter: independent of this one
    assert chi2_pvalue((u[0] * 10).long() * 10 + (nxt[0] * 10).long(), torch.full((100,), 1 / 100)) > 1e-4
    assert torch.equal(philox_uniforms(keys[1:], torch.tensor(7), 5), u[1:, :5])  # a row's draws are its own


@pytest.mark.parametrize("rng", ["generator", "philox"])
def test_consecutive_rounds_draw_independently(chi2_pvalue, rng):
    """Plain AR through the captured draw, two rounds of 100k rows from the same p: the pair of tokens follows
    p x p (a round reusing the last round's uniforms, e.g. a Philox counter that does not advance, gives y2 = y1)."""
    n = 100_000
    p = torch.rand(V, generator=torch.Generator().manual_seed(4)).pow(2)
    p = (p / p.sum())[None, None].expand(n, 1, V)
    verify = CapturedVerify(Compiler(backend="eager", verify=True, rng=rng), n, 0, "cpu")
    state = SequenceState(torch.zeros(n, dtype=torch.long), 8, generator=torch.Generator().manual_seed(5))
    y1, y2 = (verify(Exact(), Proposal.empty(n, "cpu"), p, state, greedy=False)[0].tokens[:, 0] for _ in range(2))
    assert chi2_pvalue(y1 * V + y2, (p[0, 0, :, None] * p[0, 0]).flatten()) > 1e-4


def test_philox_is_reproducible_and_draws_nothing_outside_the_graph(captured, captured_philox, monkeypatch):
    """The same per-row generators give the same tokens; per round, the eager ops of a philox verification do not
    grow with the rows (their keys are gathered, not drawn), where the generator path draws from every row's
    generator (one launch each)."""
    first = run(captured_philox, "eagle-chain", [0, 1, 2], per_row=True).images
    assert torch.equal(first, run(captured_philox, "eagle-chain", [0, 1, 2], per_row=True).images)
    assert not torch.equal(first, run(captured, "eagle-chain", [0, 1, 2], per_row=True).images)  # another stream
    ops = {}
    for name, pipe in (("generator", captured), ("philox", captured_philox)):
        for rows in ([0, 1, 2], [0, 1, 2, 3, 0, 1]):
            run(pipe, "eagle-chain", rows, per_row=True)  # every graph of these shapes exists
            with torch.no_grad(), graphs_as_launches(pipe, monkeypatch) as (verify_ops, _), OpCount():
                run(pipe, "eagle-chain", rows, per_row=True)
            ops[name, len(rows)] = statistics.median(verify_ops)  # a full-bucket round (the first makes the keys)
    assert ops["philox", 6] == ops["philox", 3] == 3, ops  # the keys' gather, the launch, the counter
    assert ops["philox", 3] < ops["generator", 3] < ops["generator", 6], ops  # 12 and 21: 3 ops a row's draw


def test_philox_under_cpu_inductor_is_bit_identical():
    """The int64 word arithmetic survives code generation: `philox_uniforms` compiled by CPU inductor (fullgraph)
    gives eager's bits, at a counter past 2^32 too (its high word used)."""
    from mmspec.philox import philox_uniforms

    keys = torch.randint(0, 1 << 32, (5, 2), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(philox_uniforms, fullgraph=True, dynamic=False)
    for offset in (3, (1 << 40) + 7):
        assert torch.equal(compiled(keys, torch.tensor(offset), 9), philox_uniforms(keys, torch.tensor(offset), 9))


def test_jacobi_round_under_cpu_inductor_equals_eager():
    """SCD's captured round (exact rule) compiled by CPU inductor (fullgraph) gives the uncompiled function's tokens,
    acceptance, carried window and buffer on the same uniforms: the law the tests above prove holds for the
    generated code too."""
    gen = torch.Generator().manual_seed(5)
    p = torch.rand(6, 4, V, generator=gen).pow(3).softmax(-1)
    q = torch.rand(6, 3, V, generator=gen).pow(3).softmax(-1)
    tokens, lengths = torch.randint(0, V, (6, 3), generator=gen), torch.tensor([3, 1, 2, 3, 2, 1])
    uniforms = torch.rand(6, 3 * 3 + 2, generator=gen, dtype=torch.float64)
    held = torch.full((6, 10 + 4), -1), torch.tensor([1, 3, 9, 0, 2, 5]), torch.zeros(6, dtype=torch.bool)
    args = (Exact(), tokens, p, q, lengths, uniforms, *held, 10, None)
    want = captured_round(*args, jacobi=True)
    got = torch.compile(captured_round, fullgraph=True, dynamic=False)(*args, jacobi=True)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(g, w) if not w.is_floating_point() else torch.allclose(g, w, rtol=1e-6, atol=1e-7)
