"""Draft-length policies (`mmspec.drafters.lengths`, `draft_length=`): each row drafts its own K per round.

The schedules themselves (transformers' heuristic, the cost model's choice, the registry's resolution); the law:
the whole engine on a table-driven toy AR (as SJD-PAC's test) with a toy chain drafter built on the library's
chain pieces (`chain_lengths`, `sample_chain`, per-row generators), whose rows' K diverge round by round -- the
joint law of the generated sequences equals the model's (chi-square); greedy output equal to plain through the VLM
and image pipelines at batch 1 and on ragged batches where the rows' K diverge; the first sampled tokens through the
VLM pipeline with rows drafting different K in the same round (chi-square against exact enumeration).
"""

import factories
import pytest
import torch
from test_pipeline_vlm import _exact_marginals
from vlm_fixtures import prompts, tiny_lm, tiny_tokenizer, train_tiny_head

from mmspec.decoding import Guidance, SequenceState, decode
from mmspec.decoding.draft_length import DraftLength
from mmspec.decoding.drafter import Proposal
from mmspec.decoding.target import TargetOutput
from mmspec.drafters.chain import chain_lengths, sample_chain
from mmspec.drafters.lengths import (
    POLICIES,
    BatchCalibratedLength,
    BatchCostLength,
    CalibratedLength,
    ConfidenceStop,
    CostLength,
    FixedLength,
    HeuristicLength,
)
from mmspec.drafters.lengths import make_draft_length as real_make_draft_length
from mmspec.drafters.lengths.batch_cost import batch_token_cost
from mmspec.drafters.lengths.cost import expected_rate
from mmspec.methods import DEFAULT_DRAFT_CONFIDENCE, DRAFT_LENGTHS, DRAFT_STEP_COSTS, resolve_method
from mmspec.sampling import SamplingParams
from mmspec.stats import SpecStats
from mmspec.verify import Exact


# ---------------------------------------------------------------------- the schedules
def test_registry_names_the_policies():
    assert set(DRAFT_LENGTHS) == set(POLICIES)
    for name, policy in POLICIES.items():
        assert policy.name == name
        assert isinstance(make_policy(name, 4), DraftLength)


def make_policy(name, k_max, **knobs):
    method = resolve_method("exact", "model", None, "vlm", num_draft_tokens=k_max, draft_length=name, **knobs)
    return real_make_draft_length(method, k_max)


def test_heuristic_is_transformers_schedule():
    """Starts at K_max (transformers: its configured num_assistant_tokens), +2 after a fully accepted round, -1
    otherwise, per row, within [1, K_max]."""
    policy = HeuristicLength(6)
    policy.start(3, "cpu")
    assert policy.host_max == 6 and policy.lengths().tolist() == [6, 6, 6]
    done = torch.zeros(3, dtype=torch.bool)
    policy.update(torch.tensor([6, 6, 6]), torch.tensor([6, 2, 0]), done)
    assert policy.lengths().tolist() == [6, 5, 5]  # capped at K_max; -1 after a rejection
    for _ in range(6):
        policy.update(policy.lengths(), torch.zeros(3, dtype=torch.long), done)
    assert policy.lengths().tolist() == [1, 1, 1]  # never below 1
    policy.update(torch.tensor([1, 1, 1]), torch.tensor([1, 0, 1]), torch.tensor([False, False, True]))
    assert policy.lengths().tolist() == [3, 1, 3]
    assert int(policy.sync_value()) == 3
    policy.select_rows(torch.tensor([1]))
    policy.sync_host(1)
    assert policy.lengths().tolist() == [1] and policy.host_max == 1


def test_cost_model_drafts_longer_for_rows_that_accept_more():
    alpha = torch.tensor([0.0, 0.5, 0.95], dtype=torch.float64)
    survival = alpha[:, None] ** torch.arange(1, 9, dtype=torch.float64)  # a geometric run: S(i) = alpha^i
    rate = expected_rate(survival, 0.25, 0.2)
    assert torch.allclose(rate[0], 1 / (1 + 0.45 * torch.arange(1, 9, dtype=torch.float64)))  # E(K) = 1
    assert rate[2, 1].item() == pytest.approx((1 + 0.95 + 0.95**2) / 1.9)  # K = 2: 3 tokens at most, cost 1.9
    policy = CostLength(8, draft_step_cost=0.1, verify_token_cost=0.1)
    policy.start(2, "cpu")
    assert policy.host_max == int(policy.best_k(torch.full((8,), 0.2, dtype=torch.float64))) == policy.first_k()
    done = torch.zeros(2, dtype=torch.bool)
    for _ in range(6):  # row 0 accepts all it drafts, row 1 nothing
        k = policy.lengths()
        policy.update(k, torch.stack([k[0], torch.tensor(0)]), done)
    hazard, k = policy.hazard(), policy.lengths()
    assert hazard[0, :4].max() < 0.2 < 0.5 < hazard[1, 0]  # row 1 was rejected at its first draft every round
    assert k[0] >= 6 and k[1] <= 2  # (positions row 1 never reached keep the prior)
    # a run that, once past its first draft, goes on: longer K than the same first-draft hazard alone would give
    bursty = torch.tensor([[0.3] + [0.02] * 7], dtype=torch.float64)
    assert policy.best_k(bursty) > policy.best_k(torch.full((1, 8), 0.3, dtype=torch.float64))
    assert CostLength(8, draft_step_cost=5.0, verify_token_cost=5.0).first_k() == 1  # drafts too dear: K = 1


def test_batch_cost_prices_the_round_the_batch_pays():
    """`"batch-cost"`: every running row drafts the one W maximising sum_r E_r(W) / (1 + (v_B + d) W), checked
    against the formula evaluated here in plain Python from the policy's own hazards; a finished row's run does not
    count; at batch 1 it is `"cost"` (with the chained prior) round for round."""
    assert batch_token_cost(0.3, 1) == pytest.approx(0.3) and batch_token_cost(0.3, 4) == pytest.approx(1.2 / 1.9)
    one, alone = BatchCostLength(8, 0.1, 0.3), CostLength(8, 0.1, 0.3, chained_prior=True)
    for policy in (one, alone):
        policy.start(1, "cpu")
    assert one.host_max == alone.host_max
    for accepted in (8, 8, 2, 0, 8, 5):
        for policy in (one, alone):
            k = policy.lengths()
            policy.update(k, k.clamp(max=accepted), torch.zeros(1, dtype=torch.bool))
        assert one.lengths().tolist() == alone.lengths().tolist()

    d, v, rows = 0.05, 0.1, 3
    policy = BatchCostLength(8, d, v)
    policy.start(rows, "cpu")
    assert policy.first_k() <= CostLength(8, d, v).first_k()  # a further token costs a batch more
    finished = torch.tensor([False, False, True])
    for _ in range(6):  # row 0 accepts everything, row 1 at most two drafts, row 2 (finished) everything
        k = policy.lengths()
        assert len(set(k.tolist())) == 1  # one K for the batch
        policy.update(k, torch.stack([k[0], k[1].clamp(max=2), k[2]]), finished)
    hazard = policy.hazard().tolist()

    def width(use):
        v_b = v * len(use) / (1 + v * (len(use) - 1))
        rates = []
        for w in range(1, 9):
            tokens = 0.0
            for r in use:
                survival, total = 1.0, 1.0
                for i in range(w):
                    survival *= 1 - hazard[r][i]
                    total += survival
                tokens += total
            rates.append(tokens / (1 + (v_b + d) * w))
        return 1 + rates.index(max(rates))

    assert policy.lengths().tolist() == [width([0, 1])] * rows
    assert int(policy.sync_value()) == width([0, 1])
    assert width([0, 1]) != width([0, 1, 2])  # the finished row would have changed the width
    policy.update(policy.lengths(), policy.lengths(), torch.ones(rows, dtype=torch.bool))
    assert int(policy.sync_value()) == 0  # every row finished: the loop stops


def test_chained_prior_lets_unreached_positions_follow_the_deepest_reached():
    """With the chained prior, position i's prior is position i - 1's estimate: after rounds that drafted one token
    and had it accepted, positions 2.. carry position 1's low hazard (the fixed prior keeps 0.2 there), checked
    against the recursion evaluated here, and the policy's next K grows."""
    r0, n0 = 0.4, 2.0
    chained, fixed = CostLength(8, 0.05, 0.3, chained_prior=True), CostLength(8, 0.05, 0.3)
    for policy in (chained, fixed):
        policy.start(1, "cpu")
        for _ in range(5):
            one = torch.ones(1, dtype=torch.long)
            policy.observe(one, one)
    assert torch.allclose(fixed.hazard()[0, 1:], torch.tensor(0.2))
    reached, rejected = chained.counts[:, 0].tolist()
    want, h = [], (rejected[0] + r0) / (reached[0] + n0)
    for i in range(8):
        h = h if i == 0 else (rejected[i] + n0 * h) / (reached[i] + n0)
        want.append(h)
    assert torch.allclose(chained.hazard()[0], torch.tensor(want, dtype=chained.counts.dtype))
    assert chained.hazard()[0, 1:].max() < 0.1 < 0.2
    assert int(chained.best_k(chained.hazard())) > int(fixed.best_k(fixed.hazard()))


def test_registry_resolves_the_draft_length_knobs():
    method = resolve_method("exact", "model", None, "vlm", draft_confidence=0.3)
    assert method.draft_length == "confidence" and method.draft_confidence == 0.3  # the knob's old meaning
    method = resolve_method("exact", "model", None, "vlm", draft_length="confidence")
    assert method.draft_confidence == DEFAULT_DRAFT_CONFIDENCE
    for drafter in ("model", "eagle"):
        method = resolve_method("greedy", drafter, None, "vlm", draft_length="cost")
        assert (method.draft_step_cost, method.verify_token_cost) == (DRAFT_STEP_COSTS[drafter], 0.3)
    fixed = resolve_method("exact", "model", None, "vlm")
    assert (fixed.draft_length, fixed.draft_confidence, fixed.draft_step_cost) == ("fixed", None, None)
    policy = real_make_draft_length(fixed, 4)
    assert isinstance(policy, FixedLength) and policy.lengths() is None and policy.sync_value() is None
    assert isinstance(make_policy("confidence", 4), ConfidenceStop)
    calibrated = make_policy("calibrated", 4, verify_costs=(1, 1.5, 1.8))
    assert isinstance(calibrated, CalibratedLength) and calibrated.verify_costs == (1, 1.5, 1.8)
    assert calibrated.d == DRAFT_STEP_COSTS["model"]
    bad = [
        (dict(draft_length="longest"), ValueError, "draft_length"),
        (dict(draft_length=1), TypeError, "draft_length"),
        (dict(draft_confidence=0.0), ValueError, "draft_confidence"),
        (dict(draft_step_cost=-0.1, draft_length="cost"), ValueError, "draft_step_cost"),
        (dict(verify_token_cost=float("nan"), draft_length="cost"), ValueError, "verify_token_cost"),
        (dict(draft_step_cost=0.1), ValueError, "draft_step_cost"),  # a cost knob without the cost policy
        (dict(verify_costs=(1, 2)), ValueError, "verify_costs"),  # likewise
        (dict(verify_costs=(1, 2), draft_length="batch-cost"), ValueError, "verify_costs"),
        (dict(verify_costs=(1, 2), verify_token_cost=0.2, draft_length="cost"), ValueError, "verify_costs"),
        (dict(verify_costs=(2, 3), draft_length="cost"), ValueError, "verify_costs"),  # c(1) is 1
        (dict(verify_costs=(1,), draft_length="cost"), ValueError, "verify_costs"),
        (dict(verify_costs=(1, float("inf")), draft_length="cost"), ValueError, "verify_costs"),
        (dict(verify_costs="1,2", draft_length="cost"), TypeError, "verify_costs"),  # a string: the CLI's form only
        (dict(draft_length="heuristic", tree_top_k=2, num_draft_tokens=None), ValueError, "draft_length"),
        (dict(draft_length="calibrated", draft_confidence=0.5), ValueError, "draft_confidence"),  # its own stop
        (dict(verify_costs=(1, 2), draft_length="heuristic"), ValueError, "verify_costs"),
    ]
    for knobs, error, match in bad:
        with pytest.raises(error, match=match):
            resolve_method("exact", "model", None, "vlm", **knobs)
    for acceptance, drafter in (("jacobi", "jacobi"), ("none", None)):
        with pytest.raises(ValueError, match="draft_length"):
            resolve_method(acceptance, drafter, None, "image", draft_length="heuristic")


def test_cost_model_prices_verification_by_the_measured_table():
    """`verify_costs` replaces the line `1 + v (m - 1)`: a table equal to the line picks the line's K for any
    hazards; the zoo VLM's measured table (a jump at 4 tokens, AMD EPYC) moves a row whose drafts are accepted 90 % of
    the time from K = 3 (the line's choice) to the K that is cheapest per token under the table (K = 8: widths 7-9
    cost about what 4 does); widths past the table extend its last step."""
    from mmspec.drafters.lengths.cost import verification_costs

    assert verification_costs(4, 0.3) == pytest.approx([1.3, 1.6, 1.9, 2.2])
    assert verification_costs(4, 0.3, (1, 1.5, 2.5)) == pytest.approx([1.5, 2.5, 3.5, 4.5])  # last step repeated
    g = torch.Generator().manual_seed(0)
    hazards = torch.rand(64, 8, generator=g) * 0.6
    line = CostLength(8, draft_step_cost=0.17, verify_token_cost=0.3)
    table = CostLength(8, draft_step_cost=0.17, verify_token_cost=0.3, verify_costs=[1 + 0.3 * m for m in range(9)])
    assert torch.equal(line.best_k(hazards), table.best_k(hazards)) and len(set(line.best_k(hazards).tolist())) > 2
    measured = (1, 1.54, 1.73, 2.64, 2.38, 2.36, 2.75, 2.68, 2.68)
    steady = torch.full((1, 8), 0.1)  # 90 % of drafts accepted at every position
    survival = [0.9 ** (i + 1) for i in range(8)]
    rate = [(1 + sum(survival[:k])) / (measured[k] + 0.17 * k) for k in range(1, 9)]  # E(K) / C(K), by hand
    assert int(line.best_k(steady)) == 3
    measured_policy = CostLength(8, draft_step_cost=0.17, verify_token_cost=0.3, verify_costs=measured)
    assert int(measured_policy.best_k(steady)) == 1 + rate.index(max(rate)) == 8  # widths 7-9 cost about the same
    assert measured_policy.first_k() == 1 + max(range(8), key=lambda k: (1 + sum(0.8 ** (i + 1) for i in range(k + 1)))
                                                / (measured[k + 1] + 0.17 * (k + 1)))  # fmt: skip


CALIBRATION_COSTS = (1, 1.5, 1.8, 2.4, 2.5, 2.6)  # c(1)..c(6) of the calibrated stops' by-hand tests


def _two_sure_drafts(policy_class):
    """A calibrated policy (K_max 5, d 0.17, `CALIBRATION_COSTS`) on two rows after two sure drafts (p 0.95) each,
    which keep both rows drafting; returns `(policy, num_draft)`."""
    policy = policy_class(5, draft_step_cost=0.17, verify_token_cost=0.3, verify_costs=CALIBRATION_COSTS)
    policy.start(2, "cpu")
    num = torch.tensor([5, 5])
    for step in range(2):
        num = policy.stop(step, torch.tensor([0.95, 0.95]), num)
        assert num.tolist() == [5, 5]
    return policy, num


def test_calibrated_stop_ends_a_chain_after_an_unsure_draft_and_learns_from_what_was_accepted():
    """The in-round stop (`CalibratedLength.stop`), by hand on two rows: sure drafts (p 0.95) keep a row drafting
    while a longer verification pays; an unsure one (p 0.15: the prior's acceptance 0.15) ends its row after it,
    kept (a draft is never dropped for its own probability); a row already stopped stays stopped; the last allowed
    draft ends every row. Then `update` folds only the verified drafts into the rows' bins."""
    costs = CALIBRATION_COSTS
    policy, num = _two_sure_drafts(CalibratedLength)
    num = policy.stop(2, torch.tensor([0.95, 0.15]), num)
    # by hand: row 1 after its unsure third draft, E_3 = 1 + .95 + .95^2 + .95^2 * .15; drafting on (at .95 each)
    # never beats stopping, while row 0 (E_3 = 1 + .95 + .95^2 + .95^3) gains from a fourth and fifth draft
    e3 = 1 + 0.95 + 0.95**2 + 0.95**2 * 0.15
    s3 = 0.95**2 * 0.15
    go = [(e3 + s3 * sum(0.95**j for j in range(1, k - 2))) / (costs[k] + k * 0.17) for k in (4, 5)]
    assert max(go) < e3 / (costs[3] + 3 * 0.17) and num.tolist() == [5, 3]
    num = policy.stop(3, torch.tensor([0.95, 0.95]), num)
    assert num.tolist() == [5, 3]  # a stopped row stays stopped
    num = policy.stop(4, torch.tensor([0.95, 0.95]), num)
    assert num.tolist() == [5, 3]  # the last draft: row 0 keeps all five
    policy.update(num, torch.tensor([3, 2]), torch.tensor([False, False]))
    verified, accepted = policy.counts.unbind(-1)
    # row 0: drafts 0..3 verified (the 5th comes after its first rejection), 3 accepted, all in the top bin
    assert verified[0].tolist() == [0] * 9 + [4] and accepted[0].tolist() == [0] * 9 + [3]
    # row 1: two sure drafts accepted, the unsure one (bin 1) verified and rejected
    assert verified[1].tolist() == [0, 1] + [0] * 7 + [2] and accepted[1].tolist() == [0] * 9 + [2]
    assert policy.acceptance()[0, -1] == pytest.approx((3 + 2 * 0.95) / (4 + 2))
    assert policy.acceptance()[1, 1] == pytest.approx((0 + 2 * 0.15) / (1 + 2))
    policy.select_rows(torch.tensor([1]))
    assert policy.counts.shape == (1, 10, 2)


def test_batch_calibrated_stops_the_whole_chain_at_once_by_the_batch_rate():
    """`"batch-calibrated"`: after the same unsure draft as above, row 1 keeps drafting while row 0 is sure (the
    batch's rate still gains from a longer chain, which row 1 pays anyway), where `"calibrated"` would stop it;
    once both rows are unsure the whole chain stops, every row at the same length; at batch 1 it is `"calibrated"`."""
    policy, num = _two_sure_drafts(BatchCalibratedLength)
    num = policy.stop(2, torch.tensor([0.95, 0.15]), num)
    assert num.tolist() == [5, 5]  # the per-row stop ends row 1 here ([5, 3] in the test above)
    num = policy.stop(3, torch.tensor([0.15, 0.95]), num)
    assert num.tolist() == [4, 4]  # both rows' runs are unlikely to go on: the batch stops
    single, per_row = (P(5, draft_step_cost=0.17, verify_token_cost=0.3, verify_costs=CALIBRATION_COSTS)
                       for P in (BatchCalibratedLength, CalibratedLength))  # fmt: skip
    for p in (single, per_row):
        p.start(1, "cpu")
    for step, prob in enumerate((0.95, 0.95, 0.35, 0.95, 0.95)):
        a, b = (p.stop(step, torch.tensor([prob]), torch.tensor([5])) for p in (single, per_row))
        assert a.tolist() == b.tolist()
        if a.item() <= step + 1:
            break


# ---------------------------------------------------------------------- the law, on the toy AR engine
V, T, ROWS = 2, 6, 20_000


def _tables(seed, spread):
    """p(x_t | x_0 .. x_{t-1}), t = 1..T, as tables [V**t, V] by the base-V code of the context (x_0 = 0)."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.rand(V**t, V, generator=gen) * spread).softmax(-1) for t in range(1, T + 1)]


def _law(tables, code, n):
    """`[rows, V]` the law after a context of `n [rows]` tokens of base-V code `code` (uniform past T tokens)."""
    p = torch.full((code.shape[0], V), 1.0 / V)
    for t in range(1, T + 1):
        p = torch.where((n == t)[:, None], tables[t - 1][code.clamp(0, V**t - 1)], p)
    return p


def _joint(tables):
    joint = torch.ones(1, dtype=torch.float64)
    for t in range(T):  # the code of x_1 .. x_T (x_0 = 0 adds nothing)
        joint = (joint[:, None] * tables[t][: V**t].double()).reshape(-1)
    return joint


class ToyTarget:
    """A chain `mmspec.decoding.target.Target` over the tables; a row's committed prefix is a code and a length."""

    def __init__(self, tables, rows):
        self.tables = tables
        self.code, self.n = torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long)

    def forward(self, tokens, parents=None, return_hidden=False):
        code, n, codes, ns = self.code, self.n, [], []
        for i in range(tokens.shape[1]):
            code, n = code * V + tokens[:, i], n + 1
            codes.append(code)
            ns.append(n)
        self._last = torch.stack(codes, 1), torch.stack(ns, 1)
        return TargetOutput(torch.stack([_law(self.tables, c, m) for c, m in zip(codes, ns)], 1))

    def commit(self, num_tokens, path=None):
        last = (num_tokens - 1)[:, None]
        self.code, self.n = (x.gather(1, last)[:, 0] for x in self._last)

    def select_rows(self, index):
        self.code, self.n = self.code[index], self.n[index]


class ToyChainDrafter:
    """A chain drafter over draft tables, built on the library's chain pieces (`chain_lengths`, `sample_chain`)
    and a draft-length `policy`; records each round's `num_draft`."""

    needs_hidden = False

    def __init__(self, tables, policy):
        self.tables, self.length, self.max_width = tables, policy, policy.k_max
        self.seen = []

    def prefill(self, state, target_out):
        self.length.start(state.batch_size, "cpu")

    def propose(self, state):
        num_draft, length = chain_lengths(self.length, state)
        code = torch.zeros(state.batch_size, dtype=torch.long)
        for i in range(state.tokens.shape[1]):  # every generated token up to the pending one
            code = torch.where(i < state.count, code * V + state.tokens[:, i].clamp(min=0), code)
        ctx = [code, state.count.clone()]

        def step(feed):
            if feed is not None:
                ctx[0], ctx[1] = ctx[0] * V + feed[:, 0], ctx[1] + 1
            return _law(self.tables, *ctx).log()

        tokens, q, num_draft = sample_chain(step, None, length, Guidance(SamplingParams()), state.generator,
                                            num_draft, stop=getattr(self.length, "stop", None),
                                            draws=self.length.k_max)  # fmt: skip
        self._num_draft = num_draft
        self.seen.append(num_draft)
        return Proposal(tokens, num_draft, q_draft=q)

    def commit(self, result, target_out, state):
        self.length.update(self._num_draft, result.num_accepted, state.finished)

    def select_rows(self, index):
        self.length.select_rows(index)

    def sync_value(self):
        return self.length.sync_value()

    def sync_host(self, value):
        self.length.sync_host(value)


@pytest.mark.parametrize("name", ["heuristic", "cost", "batch-cost", "calibrated", "batch-calibrated"])
def test_adaptive_chains_keep_the_target_law_on_the_toy_ar(name, chi2_pvalue):
    """The joint law of x_1 .. x_T under adaptive per-row K (per-row generators: each row draws K_max uniforms a
    round for its drafts and its verification's fixed count, `CapturedVerify` run eagerly) equals the model's; the
    rows' K diverged (`"batch-cost"`: one K for every row, set by all rows' past rounds, and it moved)."""
    target_tables, draft_tables = _tables(0, 3.0), _tables(1, 3.0)
    # (batch-cost: a verified token priced for all ROWS rows at v = 0.3 would be ~1, so that K = 1 throughout)
    cost = dict(draft_step_cost=0.05, verify_token_cost=0.0 if name == "batch-cost" else 0.3, decay=0.5)
    if name in ("calibrated", "batch-calibrated"):
        cost = dict(draft_step_cost=0.05, verify_token_cost=0.3, decay=0.5)
    policy = HeuristicLength(3) if name == "heuristic" else POLICIES[name](3, **cost)
    drafter = ToyChainDrafter(draft_tables, policy)
    gens = [torch.Generator().manual_seed(7_000 + i) for i in range(ROWS)]
    state = SequenceState(torch.zeros(ROWS, dtype=torch.long), T + 1, generator=gens)
    drafter.prefill(state, None)
    stats = SpecStats(ROWS)
    decode(ToyTarget(target_tables, ROWS), drafter, Exact(), state, Guidance(SamplingParams()), stats)
    seqs = state.full()[:, 1:]
    assert (seqs >= 0).all()
    if name.startswith("batch-"):  # one K for the batch (rows near their end draft fewer: what is left)
        assert len({int(k.max()) for k in drafter.seen[1:]}) > 1, "K never moved"
    else:
        assert any(len(set(k.tolist())) > 1 for k in drafter.seen[1:]), "the rows' K never diverged"
    code = torch.zeros(ROWS, dtype=torch.long)
    for t in range(T):
        code = code * V + seqs[:, t]
    assert chi2_pvalue(code, _joint(target_tables)) > 1e-4


# ---------------------------------------------------------------------- through the pipelines
@pytest.fixture(scope="module")
def lm_pipe():
    from mmspec.models.hf.draft import truncated_draft
    from mmspec.pipelines.vlm import SpeculativeVLMPipeline

    target = tiny_lm(4, seed=1)
    pipe = SpeculativeVLMPipeline(target, tiny_tokenizer(), draft_model=truncated_draft(target, 3))
    pipe.set_progress_bar_config(disable=True)
    pipe.register_modules(eagle_head=train_tiny_head(pipe, None, prompts(8), steps=60))
    return pipe


class Recorded:
    """Wraps the pipelines' `make_draft_length`: keeps each call's policy and the K of its rows per round."""

    def __init__(self, make=real_make_draft_length):
        self.make, self.rounds = make, []

    def __call__(self, method, k_max):
        policy = self.make(method, k_max)
        lengths, stop = policy.lengths, getattr(policy, "stop", None)

        def recorded():
            k = lengths()
            self.rounds.append(None if k is None else k.clone())
            return k

        def recorded_stop(step, prob, num_draft):  # an in-round stop: the rows' K once the round's chain ends
            num_draft = stop(step, prob, num_draft)
            if not bool((num_draft > step + 1).any()):
                self.rounds.append(num_draft.clone())
            return num_draft

        policy.lengths = recorded
        if stop is not None:
            policy.stop = recorded_stop
        return policy

    def diverged(self):
        return any(k is not None and len(set(k.tolist())) > 1 for k in self.rounds)


@pytest.mark.parametrize("drafter", ["model", "eagle"])
@pytest.mark.parametrize("policy", ["heuristic", "cost", "batch-cost", "calibrated", "batch-calibrated"])
def test_vlm_greedy_equals_plain_while_rows_draft_different_lengths(lm_pipe, monkeypatch, drafter, policy):
    record = Recorded()
    monkeypatch.setattr("mmspec.pipelines.vlm.make_draft_length", record)
    size = dict(num_draft_tokens=6) if drafter == "model" else dict(tree_depth=6)
    costs = dict(draft_step_cost=0.1, verify_token_cost=0.2) if "cost" in policy or "calibrated" in policy else {}
    if (
        policy in ("cost", "calibrated", "batch-calibrated") and drafter == "model"
    ):  # a measured table (a jump at 3 tokens)
        costs = dict(draft_step_cost=0.1, verify_costs=(1, 1.2, 2.0, 1.6, 1.8, 2.0, 2.2))
    for n in (1, 4):  # batch 1, and a ragged batch of 4 (prompts of 2..8 words)
        texts = prompts(8)[4 - n : 4]  # prompts the tiny head was fitted on
        plain = lm_pipe(prompt=texts, max_new_tokens=24, acceptance="none", output_type="ids").sequences
        out = lm_pipe(prompt=texts, max_new_tokens=24, acceptance="greedy", drafter=drafter, draft_length=policy,
                      output_type="ids", **size, **costs)  # fmt: skip
        assert torch.equal(out.sequences, plain), n
        assert out.stats.mean_accepted_drafts > 0.2
    if policy == "batch-cost":  # one K for the batch
        assert not record.diverged()
    elif policy == "batch-calibrated":  # one stop for the batch: only a row at its last token drafts fewer
        pass
    else:
        assert record.diverged(), "the rows' K never diverged"
    assert len({int(k.max()) for k in record.rounds if k is not None}) > 1, "K never moved"


class RaggedStart(HeuristicLength):
    """A heuristic schedule whose rows start at K = 1, 2, .., k_max, 1, ..: rows draft different K already in the
    first round (where the first sampled tokens are decided)."""

    def start(self, batch, device):
        super().start(batch, device)
        self.k = torch.arange(batch, device=device) % self.k_max + 1


@pytest.mark.parametrize("drafter", ["model", "eagle"])
def test_vlm_sampled_tokens_follow_the_target_law_with_ragged_lengths(lm_pipe, monkeypatch, drafter):
    """Tokens 2 and 3 (drafted, verified, resampled in the first round, by rows drafting 1..3 tokens side by side)
    follow the exact target law (per-row generators: a row draws only its own drafts)."""
    monkeypatch.setattr("mmspec.pipelines.vlm.make_draft_length", lambda method, k_max: RaggedStart(k_max))
    text, temperature, n = prompts(1, seed=5), 1.5, 3000
    ids, _, _ = lm_pipe.encode(None, text, None, "cpu")
    law2, law3 = _exact_marginals(lm_pipe.model, ids, temperature, lm_pipe.eos_token_ids()[0])
    gens = [torch.Generator().manual_seed(20_000 + i) for i in range(n)]
    size = dict(num_draft_tokens=3) if drafter == "model" else dict(tree_depth=3)
    out = lm_pipe(prompt=text * n, max_new_tokens=3, do_sample=True, temperature=temperature, acceptance="exact",
                  drafter=drafter, draft_length="heuristic", generator=gens, output_type="ids", **size)  # fmt: skip
    assert out.stats.mean_accepted_drafts > 0.05
    factories.assert_first_tokens_follow(out.sequences, law2, law3, n)


@pytest.mark.parametrize("drafter", ["model", "eagle"])
def test_image_greedy_equals_plain_with_adaptive_lengths(monkeypatch, drafter):
    from mmspec.models.llamagen.eagle import EagleHead
    from mmspec.pipelines import SpeculativeARImagePipeline

    target = factories.tiny_gpt(0, vocab_size=16, num_classes=4, block_size=16, std=0.3)
    head = EagleHead.from_target(target, initializer_range=0.3).init_weights(torch.Generator().manual_seed(2)).eval()
    pipe = SpeculativeARImagePipeline(target, factories.tiny_vq(16), factories.near_copy(target), head)
    pipe.set_progress_bar_config(disable=True)
    record = Recorded()
    monkeypatch.setattr("mmspec.pipelines.ar_image.make_draft_length", record)
    kw = dict(class_labels=[0, 1, 2], guidance_scale=2.0, do_sample=False, output_type="tokens")
    plain = pipe(acceptance="none", **kw).images
    for policy in ("heuristic", "cost", "confidence", "calibrated", "batch-calibrated"):
        size = dict(num_draft_tokens=5) if drafter == "model" else dict(tree_depth=5)
        out = pipe(acceptance="exact", drafter=drafter, draft_length=policy, **size, **kw)
        assert torch.equal(out.images, plain), policy
    # the near-copy draft model's rows accept differently; the untrained head's drafts are rarely accepted (K falls)
    assert record.diverged() if drafter == "model" else any(int(k.min()) < 5 for k in record.rounds if k is not None)
