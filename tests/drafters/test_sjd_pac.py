"""SJD-PAC (Kang et al., arXiv 2603.18599): proactive drafting (a Jacobi tree) + adaptive continuation (the main
branch's coupled re-draft), in the Jacobi drafter.

Proofs: the whole engine (`mmspec.decoding.decode`: the drafter's tree, `verify_jacobi_tree`, the target's path
commit, compaction of finished rows) on the table-driven toy AR model of the SJD test (`test_verify_jacobi`), here
as a `Target`: the joint law of the generated sequences equals the model's (chi-square over 100k independent rows,
p > 1e-4), for trees of width 2 and 3, depth 3, with coupling (and without). Greedy decoding with a tree equals
plain greedy decoding on the shipped zoo, token for token (batch 1 and a ragged batch of 3 with per-row
generators). The trace's accepted counts and the stats agree; bad knobs are refused, naming the knob.
"""

import pytest
import torch
from factories import usage_error_line

from mmspec.decoding import Guidance, SequenceState, decode
from mmspec.decoding.target import TargetOutput
from mmspec.drafters.jacobi import JacobiDrafter
from mmspec.drafters.jacobi_pac import ProactiveJacobiDrafter, make_jacobi_drafter, tree_layout
from mmspec.methods import KNOBS, check_knobs
from mmspec.sampling import SamplingParams
from mmspec.stats import SpecStats
from mmspec.verify import Exact
from mmspec.verify.jacobi_tree import main_branch


V, T = 4, 5  # vocabulary, generated tokens (after a fixed first token 0)
N_ROWS = 100_000


def _tables(seed, stickiness):
    """p(x_t | x_0 .. x_{t-1}) for t = 1..T as tables [V**t, V] indexed by the base-V code of the context (x_0 = 0);
    ``stickiness`` in [0, 1) shrinks the dependence on the context (so drafts from stale contexts are accepted)."""
    gen = torch.Generator().manual_seed(seed)
    tables = []
    for t in range(1, T + 1):
        base = torch.rand(1, V, generator=gen, dtype=torch.float64) * 3
        noise = torch.rand(V**t, V, generator=gen, dtype=torch.float64) * 3
        tables.append((base + (1 - stickiness) * noise).softmax(-1).float())
    return tables


class ToyTarget:
    """A `mmspec.decoding.target.Target` over the tables: scores chains and trees after each row's committed prefix
    (kept as a base-V code and a length) and commits the accepted path."""

    def __init__(self, tables, batch):
        self.tables = tables
        self.code = torch.zeros(batch, dtype=torch.long)  # committed tokens (x_0 ..) as a base-V code
        self.n = torch.zeros(batch, dtype=torch.long)  # committed tokens

    def forward(self, tokens, parents=None, return_hidden=False):
        batch, m = tokens.shape
        code = torch.zeros(batch, m, dtype=torch.long)
        n = torch.zeros(batch, m, dtype=torch.long)
        for i in range(m):
            if i == 0:
                pc, pn = self.code, self.n
            else:
                par = torch.full((batch,), i - 1) if parents is None else parents[:, i]
                pc, pn = code.gather(1, par[:, None])[:, 0], n.gather(1, par[:, None])[:, 0]
            code[:, i], n[:, i] = (pc * V + tokens[:, i]).clamp(max=V**T - 1), pn + 1
        p = torch.full((batch, m, V), 1.0 / V)
        for t in range(1, T + 1):  # a context of t tokens: x_t ~ tables[t-1]
            here = n == t
            p = torch.where(here[..., None], self.tables[t - 1][code.clamp(max=V**t - 1)], p)
        self._last = code, n
        return TargetOutput(p)

    def commit(self, num_tokens, path=None):
        code, n = self._last
        last = (num_tokens - 1) if path is None else path.gather(1, (num_tokens - 1)[:, None])[:, 0]
        self.code, self.n = code.gather(1, last[:, None])[:, 0], n.gather(1, last[:, None])[:, 0]

    def select_rows(self, index):
        self.code, self.n = self.code[index], self.n[index]


def _run(tables, drafter, gen, rows=N_ROWS, compiler=None):
    """Decode ``rows`` sequences of T tokens after x_0 = 0 with the engine; returns (sequences [rows, T], stats,
    state). `compiler`: the target's (`enable_compile(verify=True)`'s captured verification)."""
    state = SequenceState(torch.zeros(rows, dtype=torch.long), T + 1, generator=gen)
    target = ToyTarget(tables, rows)
    target.compiler = drafter.compiler = compiler
    stats = SpecStats(rows)
    drafter.prefill(state, None)
    decode(target, drafter, Exact(), state, Guidance(SamplingParams()), stats)
    return state.full()[:, 1:], stats, state


def _joint(tables):
    joint = torch.ones(1, dtype=torch.float64)
    for t in range(T):  # code of x_1 .. x_T (x_0 = 0 adds nothing)
        joint = (joint[:, None] * tables[t][: V**t].double()).reshape(-1)
    return joint


def _codes(seqs):
    code = torch.zeros(seqs.shape[0], dtype=torch.long)
    for t in range(T):
        code = code * V + seqs[:, t]
    return code


@pytest.mark.parametrize(
    "width, init, coupling", [(3, "random", True), (2, "repeat", True), (3, "repeat", False)], ids=str
)
def test_sjd_pac_engine_is_lossless_on_the_toy_ar(width, init, coupling, make_generator, chi2_pvalue):
    tables = _tables(0, stickiness=0.6)
    drafter = ProactiveJacobiDrafter(V, window=4, width=width, depth=3, init=init, coupling=coupling)
    seqs, stats, _ = _run(tables, drafter, make_generator(11 + width))
    assert (seqs >= 0).all()
    assert chi2_pvalue(_codes(seqs), _joint(tables)) > 1e-4


def test_sjd_pac_engine_with_per_row_generators_is_lossless_on_the_toy_ar(chi2_pvalue, monkeypatch):
    """Eager, one generator per row (20k rows): every row draws a fixed count a round (the whole window's fill and
    sibling draws, the verification's `uniform_count` through `CapturedVerify` run uncompiled), never per-row
    counts; every round verifies that way (none falls back to `verify_proposal`, whose draws read per-row counts),
    and the joint law is still the model's."""
    import mmspec.decoding.loop as loop
    from mmspec.decoding.captured_verify import CapturedVerify

    calls, fallback = [], []
    call, verify = CapturedVerify.__call__, loop.verify_proposal
    monkeypatch.setattr(CapturedVerify, "__call__", lambda self, *a, **k: calls.append(1) or call(self, *a, **k))
    monkeypatch.setattr(loop, "verify_proposal", lambda *a, **k: fallback.append(1) or verify(*a, **k))
    tables, rows = _tables(0, stickiness=0.6), 20_000
    drafter = ProactiveJacobiDrafter(V, window=4, width=3, depth=3, init="random", coupling=True)
    seqs, stats, _ = _run(tables, drafter, [torch.Generator().manual_seed(i) for i in range(rows)], rows=rows)
    assert (seqs >= 0).all() and len(calls) == stats.target_forwards > 0 and not fallback
    assert chi2_pvalue(_codes(seqs), _joint(tables)) > 1e-4


@pytest.mark.parametrize("rng", ["generator", "philox"])
def test_captured_sjd_pac_engine_is_lossless_on_the_toy_ar(rng, make_generator, chi2_pvalue, monkeypatch):
    """The same proof with the round captured (`enable_compile(verify=True)`: the proposal's sibling draws in one
    graph (`mmspec.drafters.jacobi_pac.proactive_round`), the Jacobi tree's verification, its chain tail, the main
    branch's coupled re-draft and the emit in another, on uniforms drawn at once, or made in the graphs by Philox):
    the joint law of the sequences is still the model's, and the graphs ran the rounds."""
    from mmspec.decoding.captured_verify import CapturedVerify
    from mmspec.decoding.compiled import Compiler

    calls = []
    call = CapturedVerify.__call__
    monkeypatch.setattr(CapturedVerify, "__call__", lambda self, *a, **k: calls.append(1) or call(self, *a, **k))
    tables = _tables(0, stickiness=0.6)
    drafter = ProactiveJacobiDrafter(V, window=4, width=3, depth=3, init="random", coupling=True)
    compiler = Compiler(backend="eager", verify=True, rng=rng)
    seqs, stats, _ = _run(tables, drafter, make_generator(17), compiler=compiler)
    report = compiler.report()
    assert (seqs >= 0).all() and len(calls) > 0 and report["verify"]["recompiles"] == 0
    assert report["draft"]["calls"] > 0 and report["draft"]["recompiles"] == 0, report
    assert chi2_pvalue(_codes(seqs), _joint(tables)) > 1e-4


def test_sjd_pac_accepts_side_branches_and_beats_the_chain(make_generator):
    """The tree is not decoration: on the toy AR, SJD-PAC needs fewer target forwards per row than SJD + SCD with
    the same window (same seed, 100k rows; each mean's standard error is ~0.003 forwards)."""
    tables = _tables(1, stickiness=0.3)
    forwards = {}
    for name, drafter in [
        ("chain", JacobiDrafter(V, 4, "random", True)),
        ("tree", ProactiveJacobiDrafter(V, 4, width=3, depth=3, init="random", coupling=True)),
    ]:
        _, _, state = _run(tables, drafter, make_generator(5))
        forwards[name] = state.full_trace().round.amax(1).double().mean().item()
    assert forwards["chain"] - forwards["tree"] > 0.05, forwards


def test_tree_layout_and_main_branch():
    parents, position, starts = tree_layout(width=2, depth=3, window=4)
    # positions 1, 2 branch 2 ways (2 + 4 nodes), then a chain under the main branch for positions 3, 4
    assert parents == [-1, -1, 0, 0, 1, 1, 2, 6]
    assert position == [1, 1, 2, 2, 2, 2, 3, 4]
    assert starts == [0, 2, 6, 7]
    assert main_branch(torch.tensor(parents)) == [0, 2, 6, 7]
    drafter = ProactiveJacobiDrafter(V, window=4, width=2, depth=3)
    assert drafter.max_width == 8


def test_proposal_siblings_are_distinct_draws_from_the_window_law(make_generator):
    """Main children carry the window's drafts; side siblings are distinct, never the main draft, drawn from q_j
    (tokens with q_j = 0 never appear); a point-mass q_j gives no side sibling; q_draft is the position's law."""
    gen = make_generator(3)
    batch = 2000
    drafter = ProactiveJacobiDrafter(V, window=3, width=3, depth=3, init="random", coupling=True)
    state = SequenceState(torch.zeros(batch, dtype=torch.long), 10, generator=gen)
    drafter.prefill(state, None)
    q1 = torch.tensor([0.5, 0.3, 0.2, 0.0])
    drafter.q_draft[:, 0] = q1
    drafter.drafts[:, 0] = torch.multinomial(q1, batch, replacement=True, generator=gen)
    prop = drafter.propose(state)
    parents, position, starts = tree_layout(3, 3, 3)
    tok = prop.tokens
    assert torch.equal(tok[:, starts], drafter.drafts)  # the main branch is the window
    level1 = tok[:, :3]
    assert (level1[:, 1:] != 3).all()  # q = 0 there
    assert (level1[:, 0] != level1[:, 1]).all() and (level1[:, 1] != level1[:, 2]).all()
    assert (level1[:, 0] != level1[:, 2]).all()
    # position 2 has a fresh (point-mass) draft: only the main child under the main node, one child per side node
    level2 = tok[:, 3:12].view(batch, 3, 3)
    assert (level2[:, 0, 1:] == -1).all() and (level2[:, 1:, 0] == drafter.drafts[:, 1, None]).all()
    assert (level2[:, 1:, 1:] == -1).all()
    assert torch.equal(prop.q_draft[:, 0], drafter.q_draft[:, 0]) and torch.equal(
        prop.q_draft[:, 5], drafter.q_draft[:, 1]
    )
    # the second sibling of the main draft d follows the without-replacement law q(x) / (1 - q(d))
    d, s = level1[:, 0], level1[:, 1]
    for main_tok in range(3):
        rows = d == main_tok
        expect = q1.clone()
        expect[main_tok] = 0
        expect = expect / expect.sum()
        freq = torch.bincount(s[rows], minlength=V).double() / rows.sum()
        assert (freq - expect).abs().max() < 0.06, (main_tok, freq, expect)


def test_knob_refusals():
    with pytest.raises(ValueError, match="jacobi_tree_width"):
        check_knobs(jacobi_tree_width=0)
    with pytest.raises(ValueError, match="jacobi_tree_width"):
        check_knobs(jacobi_tree_width=17)
    with pytest.raises(ValueError, match="jacobi_tree_depth"):
        check_knobs(jacobi_tree_depth=1)
    with pytest.raises(TypeError, match="jacobi_tree_depth"):
        check_knobs(jacobi_tree_depth=2.5)
    with pytest.raises(ValueError, match="jacobi_tree_depth"):
        check_knobs(jacobi_tree_width=3, jacobi_tree_depth=6, jacobi_window=4)  # 5 tree positions, window 4
    with pytest.raises(ValueError, match="jacobi_tree_width"):
        check_knobs(jacobi_tree_width=16, jacobi_tree_depth=8, jacobi_window=16)  # 16**7 nodes
    with pytest.raises(ValueError, match="jacobi_tree_depth"):
        ProactiveJacobiDrafter(V, window=2, width=2, depth=4)
    with pytest.raises(ValueError, match="jacobi_tree_width"):
        make_jacobi_drafter(V, dict(jacobi_window=4, jacobi_init="repeat", coupling=True, jacobi_tree_width=0))
    assert KNOBS["jacobi_tree_width"].default == 1
    knobs = dict(jacobi_window=4, jacobi_init="repeat", coupling=True)
    assert type(make_jacobi_drafter(V, knobs)) is JacobiDrafter
    assert type(make_jacobi_drafter(V, knobs | dict(jacobi_tree_width=2))) is ProactiveJacobiDrafter


@pytest.fixture(scope="module")
def zoo_pipe():
    from mmspec.pipelines import SpeculativeARImagePipeline

    pipe = SpeculativeARImagePipeline.from_zoo()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("labels", [[3], [0, 7, 4]], ids=["batch1", "ragged3"])
def test_greedy_sjd_pac_equals_plain_greedy_on_the_zoo(zoo_pipe, labels):
    gens = [torch.Generator().manual_seed(i) for i in range(len(labels))]
    plain = zoo_pipe(class_labels=labels, acceptance="none", do_sample=False, output_type="tokens", generator=gens)
    gens = [torch.Generator().manual_seed(i) for i in range(len(labels))]
    out = zoo_pipe(class_labels=labels, acceptance="jacobi", jacobi_tree_width=3, jacobi_tree_depth=3,
                   jacobi_window=8, do_sample=False, output_type="tokens", generator=gens)  # fmt: skip
    assert torch.equal(out.images, plain.images)
    assert out.stats.target_forwards < plain.stats.target_forwards


def test_sampled_sjd_pac_rows_do_not_depend_on_their_batch_on_the_zoo(zoo_pipe):
    """Sampled, eager, per-row generators: a row alone equals the same row in a ragged batch of 3 (its draws are a
    fixed count a round from its own generator, the whole window kept to the image's end), and another seed moves
    it."""
    kw = dict(acceptance="jacobi", jacobi_tree_width=3, jacobi_tree_depth=3, jacobi_window=8, output_type="tokens")

    def run(labels, seeds):
        return zoo_pipe(class_labels=labels, generator=[torch.Generator().manual_seed(s) for s in seeds], **kw).images

    batch = run([0, 3, 4], [5, 6, 7])
    assert torch.equal(run([3], [6])[0], batch[1])
    assert not torch.equal(run([3], [8])[0], batch[1])


def test_trace_and_stats_agree_on_the_zoo(zoo_pipe):
    """Sampled SJD-PAC on the zoo (ragged batch of 2): per row and round, the trace's tokens are the accepted drafts
    then one closing token; a round closes with a bonus exactly when its path reached a leaf (every leaf of the tree
    is at depth >= depth - 1, and a round that accepted the whole window closes with a bonus); the per-row accepted
    counts and rounds of the stats are those of the trace."""
    from mmspec.decoding import ACCEPTED, BONUS, RESAMPLED

    depth, window = 3, 8
    gens = [torch.Generator().manual_seed(10 + i) for i in range(2)]
    out = zoo_pipe(class_labels=[2, 5], acceptance="jacobi", jacobi_tree_width=3, jacobi_tree_depth=depth,
                   jacobi_window=window, output_type="tokens", generator=gens)  # fmt: skip
    trace, stats = out.trace, out.stats
    for b in range(2):
        rounds = int(trace.round[b].max())
        per_round_accepted = []
        for r in range(1, rounds + 1):
            origin = trace.origin[b][trace.round[b] == r]
            accepted = int((origin == ACCEPTED).sum())
            per_round_accepted.append(accepted)
            assert accepted <= window and (origin[:accepted] == ACCEPTED).all()
            assert origin[-1] in (BONUS, RESAMPLED) or r == rounds  # the last round may be cut at the image end
            if origin[-1] == BONUS and r < rounds:
                assert accepted >= depth - 1
            if accepted == window:
                assert origin[-1] == BONUS
        assert sum(per_round_accepted) == stats.accepted_tokens[b]
        assert trace.counts()["accepted"][b] == stats.accepted_tokens[b]
    assert max(per_round_accepted) > 0


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["generate", "--jacobi-tree-width", "0"], "--jacobi-tree-width"),
        (["generate", "--jacobi-tree-depth", "1"], "--jacobi-tree-depth"),
        (
            ["generate", "--jacobi-tree-width", "3", "--jacobi-tree-depth", "6", "--jacobi-window", "4"],
            "--jacobi-tree-depth",
        ),
        (
            ["bench", "ar-image", "--methods", "jacobi", "--jacobi-tree-width", "9", "--jacobi-tree-depth", "5"],
            "--jacobi-tree-width",
        ),
    ],
    ids=["width0", "depth1", "deeper-than-window", "too-many-nodes"],
)
def test_cli_refuses_bad_tree_knobs_before_loading(argv, flag, capsys, monkeypatch):
    from mmspec import cli
    from mmspec.pipelines import SpeculativeARImagePipeline

    err = usage_error_line(cli.main, argv, SpeculativeARImagePipeline, "from_zoo", capsys, monkeypatch)
    assert flag in err and flag[2:].replace("-", "_") in err, err  # the flag and the knob's own message


def test_fresh_position_siblings_from_the_last_carried_law_are_verified_with_that_law(make_generator, chi2_pvalue):
    """At a fresh position (point-mass main draft) the side siblings come from the last carried position's law; the
    proposal's `q_draft` must say so, or the recursion accepts them wrongly. Position 1 is always accepted here
    (p = its draft), position 2's main draft has target probability 0.05: the emitted token there must follow p2."""
    rows = 60_000
    gen = make_generator(21)
    drafter = ProactiveJacobiDrafter(V, window=2, width=3, depth=3, init="repeat", coupling=True)
    state = SequenceState(torch.zeros(rows, dtype=torch.long), 10, generator=gen)
    drafter.prefill(state, None)
    q0 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    drafter.drafts[:, 0] = torch.multinomial(q0, rows, replacement=True, generator=gen)
    drafter.q_draft[:, 0] = q0
    drafter.drafts[:, 1] = 0  # fresh, point mass
    drafter.q_draft[:, 1] = torch.nn.functional.one_hot(torch.zeros(rows, dtype=torch.long), V).float()
    drafter.num_carried = torch.ones(rows, dtype=torch.long)
    prop = drafter.propose(state)
    assert (prop.tokens[:, 4:6] >= 0).all()  # siblings of the fresh main draft exist
    n = prop.tokens.shape[1]
    p2 = torch.tensor([0.05, 0.5, 0.05, 0.4])
    p = torch.full((rows, n + 1, V), 1.0 / V)
    p[:, 0] = torch.nn.functional.one_hot(drafter.drafts[:, 0], V).float()
    p[:, 1] = p2  # after the main node of position 1 (node 0)
    from mmspec.verify.jacobi_tree import verify_jacobi_tree

    res = verify_jacobi_tree(prop.tokens, prop.parents, p, prop.q_draft, generator=gen, coupling=True)
    assert (res.num_accepted >= 1).all() and (res.tokens[:, 0] == drafter.drafts[:, 0]).all()
    assert chi2_pvalue(res.tokens[:, 1], p2) > 1e-4
