"""Property tests (hypothesis) and input validation for every rule.

Properties: shapes, ragged batches (num_draft per row), emitted tokens in range, -1 padding, prefix-closed masks,
probability outputs sum to one, no NaN, determinism for a fixed generator seed. Errors: shape mismatch, negative /
NaN / non-normalised probabilities (NaN also for greedy rules, which take logits), q_draft = 0 at a sampled draft,
out-of-range drafts and neighbour indices, bad tree parents, unknown rule / mode / acceptance / resample names and
knobs, bad knob values (k, group_size, delta, lam), non-integer num_draft, wrong generator types -- each a ValueError
(TypeError for wrong types) naming the argument.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmspec.verify import (
    RULE_CLASSES,
    RULES,
    Exact,
    Grouped,
    Lantern,
    codebook_neighbours,
    get_rule,
    make_rule,
    rejection_step,
    residual_probs,
    verify_chain,
    verify_continuous,
    verify_exact,
    verify_greedy,
    verify_grouped,
    verify_jacobi,
    verify_relaxed,
    verify_tree,
)


def _inputs(seed, batch, k, vocab, point_mass=False, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    p = (torch.randn(batch, k + 1, vocab, generator=gen) * 2).softmax(-1).to(dtype)
    q = (torch.randn(batch, k, vocab, generator=gen) * 2).softmax(-1).to(dtype)
    drafts = torch.multinomial(q.float().reshape(-1, vocab), 1, generator=gen).reshape(batch, k)
    num_draft = torch.randint(0, k + 1, (batch,), generator=gen)
    return drafts, p, (None if point_mass else q), num_draft


CHAIN_RULES = ["exact", "greedy", "relaxed", "grouped", "jacobi", "jacobi_coupled", "jacobi_grouped"]


def _call(rule, drafts, p, q, num_draft, seed, vocab):
    gen = torch.Generator().manual_seed(seed)
    if rule == "exact":
        return verify_exact(drafts, p, q, generator=gen, num_draft=num_draft)
    if rule == "greedy":
        return verify_greedy(drafts, p, num_draft=num_draft)
    if rule == "relaxed":
        nb = codebook_neighbours(torch.randn(vocab, 3, generator=torch.Generator().manual_seed(0)), min(3, vocab - 1))
        return verify_relaxed(drafts, p, q, neighbours=nb, delta=0.2, generator=gen, num_draft=num_draft)
    if rule == "grouped":
        return verify_grouped(drafts, p, q, group_size=4, resample="optimal", generator=gen, num_draft=num_draft)
    if rule == "jacobi_grouped":  # GSD = SJD + grouped acceptance
        return verify_jacobi(drafts, p, q, generator=gen, num_draft=num_draft, acceptance="grouped", group_size=3)
    return verify_jacobi(drafts, p, q, generator=gen, num_draft=num_draft, coupling=rule == "jacobi_coupled")


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    batch=st.integers(1, 6),
    k=st.integers(0, 5),
    vocab=st.integers(2, 9),
    point_mass=st.booleans(),
    rule=st.sampled_from(CHAIN_RULES),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_chain_properties(seed, batch, k, vocab, point_mass, rule, dtype):
    drafts, p, q, num_draft = _inputs(seed, batch, k, vocab, point_mass)
    p, q = p.to(dtype), (None if q is None else q.to(dtype))  # bf16 rows sum to 1 only within ~4e-3
    drafts = torch.where(torch.arange(k) < num_draft[:, None], drafts, -1)  # padded entries may be -1
    res = _call(rule, drafts, p, q, num_draft, seed, vocab)
    n = res.num_accepted
    assert res.tokens.shape == (batch, k + 1) and res.accept_mask.shape == (batch, k)
    assert ((n >= 0) & (n <= num_draft)).all()
    assert torch.equal(res.num_emitted, n + 1)
    pos = torch.arange(k + 1)
    assert ((res.tokens >= 0) == (pos <= n[:, None])).all()
    assert (res.tokens < vocab).all()
    assert torch.equal(res.tokens[:, :k][res.accept_mask], drafts[res.accept_mask])
    assert torch.equal(res.accept_mask, torch.arange(k) < n[:, None])  # prefix-closed
    assert not torch.isnan(res.accept_prob).any()
    assert ((res.accept_prob >= 0) & (res.accept_prob <= 1)).all()
    if rule.startswith("jacobi"):
        assert res.next_q.dtype in (torch.float32, torch.float64)
        carried = torch.arange(k) < res.num_carried[:, None]
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5  # next_q rows are the given p_target rows
        sums = res.next_q.sum(-1)[carried]
        torch.testing.assert_close(sums, torch.ones_like(sums), atol=tol, rtol=0)
    again = _call(rule, drafts, p, q, num_draft, seed, vocab)
    assert torch.equal(res.tokens, again.tokens)  # deterministic given the seed


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    batch=st.integers(1, 5),
    n=st.integers(1, 8),
    vocab=st.integers(2, 7),
    mode=st.sampled_from(["deterministic", "iid", "without_replacement"]),
    data=st.data(),
)
def test_tree_properties(seed, batch, n, vocab, mode, data):
    parents = torch.tensor([data.draw(st.integers(-1, i - 1)) for i in range(n)])
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(batch, n + 1, vocab, generator=gen).softmax(-1)
    q = torch.randn(batch, n, vocab, generator=gen).softmax(-1) if mode != "deterministic" else None
    tokens = torch.randint(0, vocab, (batch, n), generator=gen)
    if mode == "without_replacement":  # distinct siblings: token = sibling rank (mod vocab), absent if too many
        rank = torch.tensor([int((parents[:i] == parents[i]).sum()) for i in range(n)])
        tokens = torch.where(rank < vocab, rank, -1).expand(batch, n).clone()
        for i in range(n):  # absent parents make their subtree absent
            if parents[i] >= 0:
                tokens[:, i] = torch.where(tokens[:, parents[i]] < 0, -1, tokens[:, i])
    res = verify_tree(tokens, parents, p, q, mode=mode, generator=torch.Generator().manual_seed(seed))
    again = verify_tree(tokens, parents, p, q, mode=mode, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(res.tokens, again.tokens) and torch.equal(res.path, again.path)
    depth = res.path.shape[1] - 1
    k = res.num_accepted
    assert ((k >= 0) & (k <= depth)).all() and torch.equal(res.accept_mask.sum(-1), k)
    for b in range(batch):
        nodes = res.path[b, 1 : k[b] + 1] - 1
        assert (res.path[b, k[b] + 1 :] == -1).all()
        prev = -1
        for node in nodes.tolist():  # path follows parent links
            assert int(parents[node]) == prev
            prev = node
        assert torch.equal(res.tokens[b, : k[b]], tokens[b, nodes])
        assert 0 <= res.tokens[b, k[b]] < vocab and (res.tokens[b, k[b] + 1 :] == -1).all()


def test_residual_probs_sum_to_one_no_nan():
    gen = torch.Generator().manual_seed(0)
    p = torch.rand(50, 7, generator=gen).softmax(-1)
    q = torch.rand(50, 7, generator=gen).softmax(-1)
    q[:10] = p[:10]
    r = residual_probs(p, q)
    assert not torch.isnan(r).any()
    torch.testing.assert_close(r.sum(-1), torch.ones(50))


# ---------------------------------------------------------------------------------------------------------------
# Errors


def _renorm(x):
    return x / x.sum(-1, keepdim=True)


def _good(batch=3, k=2, vocab=5):
    return _inputs(0, batch, k, vocab)[:3]


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d, p, q: (d, p[:, :-1], q), "p_target"),
        (lambda d, p, q: (d, p, q[:, :, :-1]), "q_draft"),
        (lambda d, p, q: (d[:, :1], p, q), "p_target"),
        (lambda d, p, q: (d.float(), p, q), "draft_tokens"),
        (lambda d, p, q: (d, p.index_fill(2, torch.tensor([0]), -0.1), q), "p_target.*negative"),
        (lambda d, p, q: (d, p.index_fill(2, torch.tensor([1]), float("nan")), q), "p_target.*NaN"),
        (lambda d, p, q: (d, p * 1.1, q), "p_target.*sum to 1"),
        (lambda d, p, q: (d, p, q.index_fill(2, torch.tensor([2]), float("nan"))), "q_draft.*NaN"),
        (lambda d, p, q: (d.index_fill(1, torch.tensor([0]), 7), p, q), "draft_tokens out of range"),
        (lambda d, p, q: (d, p, _renorm(q.scatter(2, d[..., None], 0.0))), "q_draft is 0 at a draft token"),
    ],
)
def test_bad_chain_inputs(mutate, match):
    d, p, q = mutate(*_good())
    for rule in (verify_exact, verify_jacobi):
        with pytest.raises((ValueError, TypeError), match=match):
            rule(d, p, q, generator=torch.Generator())


def test_bad_names_and_knobs():
    d, p, q = _good()
    gen = torch.Generator()
    with pytest.raises(ValueError, match="valid rules"):
        get_rule("lantern")
    assert set(RULES) == {"exact", "greedy", "tree", "relaxed", "grouped", "jacobi", "continuous"}
    assert get_rule("exact") is verify_exact
    with pytest.raises(ValueError, match="acceptance"):
        verify_jacobi(d, p, q, generator=gen, acceptance="typical")
    with pytest.raises(ValueError, match="resample"):
        verify_grouped(d, p, q, generator=gen, resample="uniform")
    nb = codebook_neighbours(torch.randn(5, 2), 2)
    with pytest.raises(ValueError, match="delta .*or lam"):
        Lantern(neighbours=nb, delta=None)  # verify_relaxed's delta=None means the rule's default
    with pytest.raises(ValueError, match="neighbours"):
        verify_relaxed(d, p, q, neighbours=nb[:4], delta=0.1, generator=gen)
    with pytest.raises(ValueError, match="k must be"):
        verify_relaxed(d, p, q, neighbours=nb, k=3, delta=0.1, generator=gen)
    with pytest.raises(ValueError, match="lam"):
        verify_relaxed(d, p, q, neighbours=nb, lam=0.5, generator=gen)
    with pytest.raises(ValueError, match="group_size"):
        verify_grouped(d, p, q, group_size=0, generator=gen)
    with pytest.raises(ValueError, match="embeddings"):
        verify_grouped(d, p, q, embeddings=torch.randn(4, 2), generator=gen)
    with pytest.raises(ValueError, match="num_draft"):
        verify_exact(d, p, q, generator=gen, num_draft=torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="num_draft"):
        verify_exact(d, p, q, generator=gen, num_draft=torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="deltas"):
        verify_jacobi(d, p, q, generator=gen, acceptance="relaxed", neighbours=nb, deltas=0.1)
    with pytest.raises(ValueError, match="neighbours"):
        verify_jacobi(d, p, q, generator=gen, acceptance="relaxed", delta=0.1)
    with pytest.raises(TypeError, match="group_size"):
        verify_tree(d, torch.tensor([-1, 0]), p, generator=gen, group_size=3)


def test_bad_tree_inputs():
    gen = torch.Generator()
    p = torch.rand(2, 4, 5).softmax(-1)
    q = torch.rand(2, 3, 5).softmax(-1)
    tok = torch.tensor([[0, 1, 2], [3, 4, 0]])
    with pytest.raises(ValueError, match="mode"):
        verify_tree(tok, torch.tensor([-1, -1, 0]), p, generator=gen, mode="beam")
    with pytest.raises(ValueError, match="parents"):
        verify_tree(tok, torch.tensor([-1, 1, 0]), p, generator=gen)
    with pytest.raises(ValueError, match="parents"):
        verify_tree(tok, torch.tensor([-1, -1]), p, generator=gen)
    with pytest.raises(ValueError, match="q_draft must be None"):
        verify_tree(tok, torch.tensor([-1, -1, 0]), p, q, generator=gen)
    with pytest.raises(ValueError, match="q_draft .* is required"):
        verify_tree(tok, torch.tensor([-1, -1, 0]), p, generator=gen, mode="iid")
    with pytest.raises(ValueError, match="distinct siblings"):
        verify_tree(
            torch.tensor([[1, 1, 2], [3, 4, 0]]),
            torch.tensor([-1, -1, 0]),
            p,
            q,
            generator=gen,
            mode="without_replacement",
        )
    with pytest.raises(ValueError, match="absent parent"):
        verify_tree(torch.tensor([[-1, 1, 2], [3, 4, 0]]), torch.tensor([-1, -1, 0]), p, generator=gen)
    with pytest.raises(ValueError, match="q_draft is 0"):
        verify_tree(
            tok, torch.tensor([-1, -1, 0]), p, _renorm(q.scatter(2, tok[..., None], 0.0)), generator=gen, mode="iid"
        )
    with pytest.raises(ValueError, match="p_target.*negative"):
        verify_tree(tok, torch.tensor([-1, -1, 0]), p - 0.5, generator=gen)
    with pytest.raises(ValueError, match="tree_tokens out of range"):
        verify_tree(tok + 5, torch.tensor([-1, -1, 0]), p, generator=gen)


def test_bad_continuous_inputs():
    gen = torch.Generator()
    x = torch.randn(2, 3, 4)
    ones = torch.ones(2, 3, 4)
    with pytest.raises(ValueError, match="target_std"):
        verify_continuous(x, x, -ones, x, ones, generator=gen)
    with pytest.raises(ValueError, match="draft_mean"):
        verify_continuous(x, x, ones, x[:, :2], ones, generator=gen)
    with pytest.raises(ValueError, match="draft_values"):
        verify_continuous(x.index_fill(0, torch.tensor([0]), float("nan")), x, ones, x, ones, generator=gen)
    with pytest.raises(ValueError, match="max_residual_tries"):
        verify_continuous(x, x, ones, x, ones, generator=gen, max_residual_tries=0)
    with pytest.raises(ValueError, match="log_ratio_offset"):
        verify_continuous(x, x, ones, x, ones, generator=gen, log_ratio_offset=torch.zeros(2))


def test_greedy_rejects_nan():
    d, p, _ = _good()
    bad = p.index_fill(2, torch.tensor([1]), float("nan"))
    with pytest.raises(ValueError, match="p_target contains NaN"):
        verify_greedy(d, bad)
    with pytest.raises(ValueError, match="p_target contains NaN"):
        verify_greedy(d, bad.log())  # logits are fine, NaN logits are not
    verify_greedy(d, p.log())
    tok = torch.tensor([[0, 1, 2], [3, 4, 0], [1, 1, 1]])
    with pytest.raises(ValueError, match="p_target contains NaN"):
        verify_tree(tok, torch.tensor([-1, -1, 0]), torch.cat([bad, p[:, :1]], 1), generator=None, greedy=True)
    verify_tree(tok, torch.tensor([-1, -1, 0]), torch.cat([p, p[:, :1]], 1).log(), generator=None, greedy=True)


def test_neighbour_indices_out_of_range():
    d, p, q = _good()
    gen = torch.Generator()
    nb = codebook_neighbours(torch.randn(5, 2), 2)
    for value in (5, 17, -1):
        bad = nb.clone()
        bad[3, 1] = value
        with pytest.raises(ValueError, match="neighbours out of range"):
            verify_relaxed(d, p, q, neighbours=bad, delta=0.3, generator=gen)
        with pytest.raises(ValueError, match="neighbours out of range"):
            verify_tree(d, torch.tensor([-1, 0]), p, generator=gen, rule=Lantern(bad))
        with pytest.raises(ValueError, match="neighbours out of range"):
            verify_jacobi(d, p, q, generator=gen, acceptance="relaxed", neighbours=bad)
    with pytest.raises(TypeError, match="neighbours must be an integer"):
        verify_relaxed(d, p, q, neighbours=nb.float(), generator=gen)


def test_bad_resample_for_every_rule():
    d, p, q = _good()
    gen = torch.Generator()
    nb = codebook_neighbours(torch.randn(5, 2), 2)
    for name, cls, knobs in [("exact", Exact, {}), ("relaxed", Lantern, {"neighbours": nb}), ("grouped", Grouped, {})]:
        with pytest.raises(ValueError, match="resample"):
            cls(resample="foo", **knobs)
        with pytest.raises(ValueError, match="resample"):
            make_rule(name, resample="foo", **knobs)
        with pytest.raises(ValueError, match="resample"):
            rejection_step(p[:, 0], q[:, 0], d[:, 0], acceptance=name, resample="foo", **knobs)
        with pytest.raises(ValueError, match="resample"):
            verify_jacobi(d, p, q, generator=gen, acceptance=name, resample="foo", **knobs)
        with pytest.raises(ValueError, match="resample"):
            verify_tree(d, torch.tensor([-1, 0]), p, generator=gen, acceptance=name, resample="foo", **knobs)
    with pytest.raises(ValueError, match="resample"):
        verify_relaxed(d, p, q, neighbours=nb, resample="foo", generator=gen)
    with pytest.raises(ValueError, match="resample"):
        verify_grouped(d, p, q, resample="foo", generator=gen)


def test_bad_knob_values():
    d, p, q = _good()
    gen = torch.Generator()
    nb = codebook_neighbours(torch.randn(5, 2), 2)
    with pytest.raises(ValueError, match="k must be >= 0"):
        verify_relaxed(d, p, q, neighbours=nb, k=-1, generator=gen)
    with pytest.raises(ValueError, match="k must be >= 0"):
        verify_tree(d, torch.tensor([-1, 0]), p, generator=gen, acceptance="relaxed", neighbours=nb, k=-2)
    with pytest.raises(TypeError, match="k must be an int"):
        Lantern(nb, k=1.5)
    with pytest.raises(ValueError, match="delta must be >= 0"):
        Lantern(nb, delta=-0.1)
    with pytest.raises(ValueError, match="delta must be >= 0"):
        Grouped(delta=float("nan"))
    for size in (2.5, True, "3"):
        with pytest.raises(TypeError, match="group_size"):
            verify_grouped(d, p, q, group_size=size, generator=gen)
        with pytest.raises(TypeError, match="group_size"):
            verify_jacobi(d, p, q, generator=gen, acceptance="grouped", group_size=size)
    with pytest.raises(ValueError, match="group_size"):
        Grouped(group_size=-3)
    Grouped(group_size=torch.tensor(3).item())  # any integral value is fine


def test_num_draft_must_be_integer():
    d, p, q = _good()
    gen = torch.Generator()
    x = torch.randn(3, 2, 4)
    ones = torch.ones(3, 2, 4)
    for num_draft in (torch.tensor([1.0, 2.0, 0.0]), torch.tensor([True, False, True])):
        for call in (
            lambda nd: verify_exact(d, p, q, generator=gen, num_draft=nd),
            lambda nd: verify_greedy(d, p, nd),
            lambda nd: verify_jacobi(d, p, q, generator=gen, num_draft=nd),
            lambda nd: verify_continuous(x, x, ones, x, ones, generator=gen, num_draft=nd),
        ):
            with pytest.raises(TypeError, match="num_draft"):
                call(num_draft)


def test_generator_type_is_checked():
    d, p, q = _good()
    x = torch.randn(3, 2, 4)
    ones = torch.ones(3, 2, 4)
    nb = codebook_neighbours(torch.randn(5, 2), 2)
    calls = [
        lambda g: verify_exact(d, p, q, generator=g),
        lambda g: verify_chain(Exact(), d, p, q, generator=g),
        lambda g: verify_relaxed(d, p, q, neighbours=nb, generator=g),
        lambda g: verify_grouped(d, p, q, generator=g),
        lambda g: verify_jacobi(d, p, q, generator=g, coupling=True),
        lambda g: verify_tree(d, torch.tensor([-1, 0]), p, generator=g),
        lambda g: verify_continuous(x, x, ones, x, ones, generator=g),
    ]
    for call in calls:
        for bad in (0, "seed", [torch.Generator(), 1, torch.Generator()]):
            with pytest.raises(TypeError, match="generator"):
                call(bad)
        with pytest.raises(ValueError, match="generator"):  # one per row
            call([torch.Generator(), torch.Generator()])
        call([torch.Generator().manual_seed(i) for i in range(3)])


def test_rule_names_and_objects():
    d, p, q = _good()
    gen = torch.Generator()
    assert set(RULE_CLASSES) == {"exact", "relaxed", "grouped"}
    with pytest.raises(ValueError, match=r"\['exact', 'relaxed', 'grouped'\]"):
        make_rule("typical")
    with pytest.raises(TypeError, match="group_sizes"):
        make_rule("grouped", group_sizes=3)
    with pytest.raises(TypeError, match="rule must be an AcceptanceRule"):
        verify_chain("exact", d, p, q, generator=gen)
    with pytest.raises(TypeError, match="rule must be an AcceptanceRule"):
        verify_tree(d, torch.tensor([-1, 0]), p, generator=gen, rule="exact")
    with pytest.raises(TypeError, match="either rule"):
        verify_jacobi(d, p, q, generator=gen, rule=Grouped(), group_size=3)
    with pytest.raises(TypeError, match="either rule"):
        verify_tree(d, torch.tensor([-1, 0]), p, generator=gen, rule=Exact(), acceptance="grouped")
    with pytest.raises(ValueError, match="greedy=True is defined for acceptance 'exact' and 'relaxed' only"):
        verify_chain(Grouped(), d, p, q, generator=gen, greedy=True)


def test_bool_draft_tokens_are_a_type_error():
    from mmspec.verify import verify_exact, verify_tree

    p = torch.full((1, 3, 4), 0.25)
    with pytest.raises(TypeError, match="draft_tokens"):
        verify_exact(torch.tensor([[True, False]]), p, None, generator=None)
    with pytest.raises(TypeError, match="tree_tokens"):
        verify_tree(torch.tensor([[True, False]]), torch.tensor([[-1, 0]]), p, generator=None)
