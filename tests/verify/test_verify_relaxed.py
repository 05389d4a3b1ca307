"""LANTERN relaxed acceptance and GSD grouped acceptance (lossy rules).

Proofs:
* building blocks match straightforward scalar references (`codebook_neighbours`, `relaxed_numerator`,
  `grouped_masses`, the all-token GSD acceptance used by G*);
* on the same generator state, relaxed acceptance (and grouped with point-mass drafts or a delta cap) is never
  below the exact rule's; singleton neighbourhoods / groups (k=0, delta=0, lam=1, group_size=1) reproduce
  `verify_exact` bit for bit;
* exact enumeration of the output law: TV(output, p) equals sum_y [q(y) a(y) - p(y)]_+ under G* and stays within
  the documented budgets (point mass: c_{m*} <= delta; sampled: <= sum_y min(q(y), delta); multiplicative:
  <= (lam-1) sum_{q>p} p);
* Monte Carlo through the public API (200k rows) matches the enumerated law (chi-square) and its empirical TV is
  within budget.
"""

import pytest
import torch

from mmspec.verify import (
    acceptance_probs,
    codebook_neighbours,
    grouped_masses,
    rejection_step,
    relaxed_numerator,
    verify_exact,
    verify_grouped,
    verify_relaxed,
)
from mmspec.verify.gsd import _grouped_accept_all  # internal, checked against a reference


V = 6
N_MC = 200_000


def _setup(seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(V, generator=gen, dtype=dtype) ** 2
    q = torch.rand(V, generator=gen, dtype=dtype) ** 2
    nb = codebook_neighbours(torch.randn(V, 3, generator=gen), V - 1)
    emb = torch.randn(V, 2, generator=gen, dtype=dtype) * 0.4
    return p / p.sum(), q / q.sum(), nb, emb


def test_codebook_neighbours_brute_force():
    gen = torch.Generator().manual_seed(0)
    book = torch.randn(40, 6, generator=gen)
    nb = codebook_neighbours(book, 5, chunk_size=7)
    unit = book / book.norm(dim=-1, keepdim=True)
    dist = torch.cdist(unit, unit)
    dist.fill_diagonal_(float("inf"))
    assert torch.equal(nb, dist.argsort(-1)[:, :5])
    assert (nb != torch.arange(40)[:, None]).all()
    scaled = book * torch.rand(40, 1, generator=gen).add(0.1) * 10  # normalised codebook: scale-invariant
    assert torch.equal(codebook_neighbours(scaled, 5), nb)
    assert codebook_neighbours(book, 0).shape == (40, 0)
    with pytest.raises(ValueError, match="k must be"):
        codebook_neighbours(book, 40)


@pytest.mark.parametrize("bound", [{"delta": 0.0}, {"delta": 0.2}, {"delta": 1.0}, {"lam": 1.0}, {"lam": 3.0}])
@pytest.mark.parametrize("k", [0, 2, None])
def test_relaxed_numerator_reference(bound, k):
    p, _, nb, _ = _setup(1)
    tokens = torch.arange(V)
    p_tilde, m_star = relaxed_numerator(p.expand(V, V), tokens, nb, k=k, **bound)
    for x in range(V):
        kk = nb.shape[1] if k is None else k
        limit = bound["delta"] if "delta" in bound else (bound["lam"] - 1) * float(p[x])
        cum, m, c = 0.0, 0, 0.0
        for j in range(kk):
            cum += float(p[nb[x, j]])
            if cum <= limit:
                m, c = j + 1, cum
        assert int(m_star[x]) == m
        assert abs(float(p_tilde[x]) - (float(p[x]) + c)) < 1e-12


def test_grouped_masses_reference():
    gen = torch.Generator().manual_seed(2)
    vocab = 30
    p = torch.rand(4, vocab, generator=gen, dtype=torch.float64).softmax(-1) ** 3
    p = p / p.sum(-1, keepdim=True)
    q = torch.rand(4, vocab, generator=gen, dtype=torch.float64).softmax(-1)
    emb = torch.randn(vocab, 3, generator=gen, dtype=torch.float64) * 0.5
    tokens = torch.randint(0, vocab, (4,), generator=gen)
    for g in (1, 5, 14):
        big_p, big_q = grouped_masses(
            p, q, tokens, group_size=g, prob_threshold=0.05, dist_threshold=0.5, embeddings=emb
        )
        for b in range(4):
            order = torch.argsort(p[b], stable=True).tolist()
            x = int(tokens[b])
            r = order.index(x)
            members = [order[i] for i in range(r - g // 2, r - g // 2 + g) if 0 <= i < vocab]
            keep = [
                v
                for v in members
                if v == x or (abs(p[b, v] - p[b, x]) < 0.05 and float(((emb[v] - emb[x]) ** 2).sum()) < 0.5)
            ]
            assert abs(float(big_p[b]) - float(p[b, keep].sum())) < 1e-12
            assert abs(float(big_q[b]) - float(q[b, keep].sum())) < 1e-12


def test_grouped_window_float32_topk_path_matches_stable_sort():
    """float32 uses an int64-key top-k window instead of a full argsort: same members, ties included."""
    gen = torch.Generator().manual_seed(9)
    vocab = 200
    p = torch.rand(6, vocab, generator=gen) ** 6
    p[:, :120] = 0.0  # many exact ties (top-k truncated targets)
    p[:, 150:160] = p[:, 150:151]  # ties at a positive value
    p = p / p.sum(-1, keepdim=True)
    q = torch.rand(6, vocab, generator=gen).softmax(-1)
    emb = torch.randn(vocab, 3, generator=gen)
    for tokens in (torch.tensor([0, 5, 119, 155, 199, 130]), torch.randint(0, vocab, (6,), generator=gen)):
        for g in (1, 2, 14, 15):
            kw = {"group_size": g, "prob_threshold": 0.5, "embeddings": emb}
            fast = grouped_masses(p, q, tokens, **kw)
            ref = grouped_masses(p.double(), q.double(), tokens, **{**kw, "embeddings": emb.double()})
            for a, b in zip(fast, ref):
                torch.testing.assert_close(a.double(), b, atol=1e-6, rtol=0)


def test_grouped_accept_all_matches_per_token():
    gen = torch.Generator().manual_seed(3)
    vocab = 25
    p = torch.rand(3, vocab, generator=gen, dtype=torch.float64) ** 4
    p = p / p.sum(-1, keepdim=True)
    q = torch.rand(3, vocab, generator=gen, dtype=torch.float64)
    q = q / q.sum(-1, keepdim=True)
    emb = torch.randn(vocab, 4, generator=gen, dtype=torch.float64) * 0.4
    for e in (None, emb):
        knobs = {"group_size": 7, "prob_threshold": 0.1, "dist_threshold": 0.5, "embeddings": e}
        a_all = _grouped_accept_all(p, q, max_elements=vocab * 4, **knobs)  # force row chunking
        for y in range(vocab):
            tok = torch.full((3,), y)
            a_y = acceptance_probs(p, q, tok, acceptance="grouped", **knobs)
            assert torch.allclose(a_all[:, y], a_y, atol=1e-12)


def _batch(seed, batch=4000, k=3):
    gen = torch.Generator().manual_seed(seed)
    p_target = (torch.rand(batch, k + 1, V, generator=gen) ** 3).softmax(-1)
    q_draft = (torch.rand(batch, k, V, generator=gen) ** 3).softmax(-1)
    drafts = torch.multinomial(q_draft.reshape(-1, V), 1, generator=gen).reshape(batch, k)
    nb = codebook_neighbours(torch.randn(V, 3, generator=gen), 4)
    emb = torch.randn(V, 2, generator=gen) * 0.4
    return drafts, p_target, q_draft, nb, emb


@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize(
    "rule",
    [
        ("relaxed", {"delta": 0.1}),
        ("relaxed", {"lam": 2.0}),
        ("relaxed", {"delta": 0.3, "resample": "released"}),
        ("grouped", {"delta": 0.2}),
        ("grouped", {"delta": 0.05, "resample": "optimal"}),
    ],
)
def test_acceptance_never_below_exact_on_same_draws(point_mass, rule, make_generator):
    drafts, p_target, q_draft, nb, emb = _batch(4)
    q = None if point_mass else q_draft
    exact = verify_exact(drafts, p_target, q, generator=make_generator(5))
    name, knobs = rule
    if name == "relaxed":
        other = verify_relaxed(drafts, p_target, q, neighbours=nb, generator=make_generator(5), **knobs)
    else:
        other = verify_grouped(drafts, p_target, q, embeddings=emb, generator=make_generator(5), **knobs)
    assert (other.accept_prob >= exact.accept_prob).all()
    assert (other.num_accepted >= exact.num_accepted).all()
    assert other.num_accepted.sum() > exact.num_accepted.sum()  # the relaxation actually does something


def test_grouped_point_mass_uncapped_is_monotone_but_sampled_is_not(make_generator):
    drafts, p_target, q_draft, _, emb = _batch(6)
    exact_pm = verify_exact(drafts, p_target, None, generator=make_generator(0))
    grouped_pm = verify_grouped(drafts, p_target, None, embeddings=emb, generator=make_generator(0))
    assert (grouped_pm.accept_prob >= exact_pm.accept_prob).all()
    # Sampled drafts: P/Q can fall below p/q (documented; GSD's theorem is about fixed partitions).
    p = torch.tensor([[0.3, 0.3, 0.4]])
    q = torch.tensor([[0.3, 0.6, 0.1]])
    a_grouped = acceptance_probs(p, q, torch.tensor([0]), acceptance="grouped", group_size=3)
    a_exact = acceptance_probs(p, q, torch.tensor([0]))
    assert float(a_grouped) < float(a_exact)


@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize("resample", ["optimal", "released"])
def test_singleton_reduces_to_exact_bitwise(point_mass, resample, make_generator):
    drafts, p_target, q_draft, nb, emb = _batch(7)
    q = None if point_mass else q_draft
    num_draft = torch.randint(0, 4, (len(drafts),), generator=make_generator(1))
    exact = verify_exact(drafts, p_target, q, generator=make_generator(8), num_draft=num_draft)
    variants = [
        lambda g: verify_relaxed(
            drafts, p_target, q, neighbours=nb, k=0, delta=0.5, resample=resample, generator=g, num_draft=num_draft
        ),
        lambda g: verify_grouped(
            drafts, p_target, q, group_size=1, resample=resample, generator=g, num_draft=num_draft
        ),
        lambda g: verify_grouped(
            drafts, p_target, q, embeddings=emb, delta=0.0, resample=resample, generator=g, num_draft=num_draft
        ),
    ]
    if resample == "optimal":  # with "released", zero-mass neighbours (c_m = 0 <= 0) still get zeroed
        variants += [
            lambda g: verify_relaxed(drafts, p_target, q, neighbours=nb, delta=0.0, generator=g, num_draft=num_draft),
            lambda g: verify_relaxed(drafts, p_target, q, neighbours=nb, lam=1.0, generator=g, num_draft=num_draft),
        ]
    for i, run in enumerate(variants):
        other = run(make_generator(8))
        assert torch.equal(other.tokens, exact.tokens), i
        assert torch.equal(other.accept_prob, exact.accept_prob), i


def _output_law(p, q, nb, emb, name, knobs):
    """Exact law of the emitted token for one draft position (float64): sum over x of q(x) [a(x) 1_x + (1-a(x)) R_x].

    a(x) comes from the public API's accept_prob, R_x from `rejection_step`.
    """
    tokens = torch.arange(V)
    p_target = torch.stack([p, p], 0).expand(V, 2, V)  # bonus row unused
    q_rows = None if q is None else q.expand(V, V)
    drafts = tokens[:, None]
    gen = torch.Generator().manual_seed(0)
    if name == "relaxed":
        res = verify_relaxed(
            drafts, p_target, None if q is None else q_rows[:, None], neighbours=nb, generator=gen, **knobs
        )
        extra = {"neighbours": nb, **{k: v for k, v in knobs.items() if k != "resample"}}
    else:
        res = verify_grouped(
            drafts, p_target, None if q is None else q_rows[:, None], embeddings=emb, generator=gen, **knobs
        )
        extra = {"embeddings": emb, **{k: v for k, v in knobs.items() if k != "resample"}}
    a = res.accept_prob[:, 0]  # [V] acceptance of draft x
    _, r = rejection_step(
        p.expand(V, V), q_rows, tokens, acceptance=name, resample=knobs.get("resample", "optimal"), **extra
    )
    per_x = a[:, None] * torch.eye(V, dtype=p.dtype) + (1 - a)[:, None] * r  # [x, y]
    return per_x, a


RELAXED_BOUNDS = [
    ("relaxed", {"delta": 0.05}),
    ("relaxed", {"delta": 0.2}),
    ("relaxed", {"lam": 1.5}),
    ("relaxed", {"lam": 4.0}),
    ("grouped", {"delta": 0.1, "group_size": 4, "prob_threshold": 0.3}),
    ("grouped", {"group_size": 4, "prob_threshold": 0.3, "resample": "optimal"}),
]


@pytest.mark.parametrize("rule", RELAXED_BOUNDS)
@pytest.mark.parametrize("seed", range(4))
def test_tv_budget_by_enumeration(rule, seed):
    p, q, nb, emb = _setup(10 + seed)
    name, knobs = rule
    budget_delta = knobs.get("delta")
    # point-mass drafts: law for draft x is per_x[x]; TV = q(x)a(x) - p(x) with q = 1_x
    per_x, a = _output_law(p, None, nb, emb, name, knobs)
    tv = 0.5 * (per_x - p).abs().sum(-1)
    excess = (a - p).clamp_min(0)
    assert torch.allclose(tv, excess, atol=1e-12)  # G*: TV = sum_y [q a - p]_+
    if budget_delta is not None:
        assert (tv <= budget_delta + 1e-12).all()
    if "lam" in knobs:
        assert (tv <= (knobs["lam"] - 1) * p + 1e-12).all()
    # sampled drafts
    per_x, a = _output_law(p, q, nb, emb, name, knobs)
    law = (q[:, None] * per_x).sum(0)
    assert abs(float(law.sum()) - 1) < 1e-12 and (law >= 0).all()
    tv = 0.5 * float((law - p).abs().sum())
    assert abs(tv - float((q * a - p).clamp_min(0).sum())) < 1e-12
    if budget_delta is not None:
        assert tv <= float(torch.minimum(q, torch.tensor(budget_delta, dtype=q.dtype)).sum()) + 1e-12
    if "lam" in knobs:
        assert tv <= (knobs["lam"] - 1) * float(p[q > p].sum()) + 1e-12
        assert tv <= knobs["lam"] - 1


@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize("rule", [("relaxed", {"delta": 0.15}), ("grouped", {"delta": 0.1, "group_size": 4})])
def test_monte_carlo_matches_enumerated_law_and_budget(point_mass, rule, make_generator, chi2_pvalue):
    p, q, nb, emb = _setup(20)
    name, knobs = rule
    per_x, _ = _output_law(p, None if point_mass else q, nb, emb, name, knobs)
    gen = make_generator(21 + point_mass)
    if point_mass:
        x = torch.full((N_MC, 1), 2)
        law = per_x[2]
        budget = knobs["delta"]
    else:
        x = torch.multinomial(q.float(), N_MC, replacement=True, generator=gen)[:, None]
        law = (q[:, None] * per_x).sum(0)
        budget = float(torch.minimum(q, torch.tensor(knobs["delta"], dtype=q.dtype)).sum())
    p_target = p.float().expand(N_MC, 2, V)
    q_draft = None if point_mass else q.float().expand(N_MC, 1, V)
    if name == "relaxed":
        res = verify_relaxed(x, p_target, q_draft, neighbours=nb, generator=gen, **knobs)
    else:
        res = verify_grouped(x, p_target, q_draft, embeddings=emb.float(), generator=gen, **knobs)
    y = res.tokens[:, 0]
    assert chi2_pvalue(y, law) > 1e-4
    empirical = torch.bincount(y, minlength=V).double() / N_MC
    tv_hat = 0.5 * float((empirical - p).abs().sum())
    assert tv_hat <= budget + 3 * (V / N_MC) ** 0.5
    assert 0.5 * float((law - p).abs().sum()) > 1e-3  # the budget is actually used


def test_released_resample_zeroes_k_plus_one_neighbours():
    p = torch.tensor([[0.3, 0.05, 0.05, 0.2, 0.4]])
    nb = torch.tensor([[1, 2, 3, 4], [0, 2, 3, 4], [0, 1, 3, 4], [0, 1, 2, 4], [0, 1, 2, 3]])
    x = torch.tensor([0])
    a, r = rejection_step(p, None, x, acceptance="relaxed", resample="released", neighbours=nb, k=2, delta=0.12)
    assert abs(float(a) - 0.4) < 1e-6  # p(0) + p(1) + p(2)
    torch.testing.assert_close(r, torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]]))  # zeroes x and neighbours 1, 2, 3
    a, r = rejection_step(p, None, x, acceptance="relaxed", resample="optimal", neighbours=nb, k=2, delta=0.12)
    torch.testing.assert_close(r, torch.tensor([[0.0, 0.05, 0.05, 0.2, 0.4]]) / 0.7)
    a, r = rejection_step(p, None, x, acceptance="relaxed", resample="released", neighbours=nb, k=2, delta=0.01)
    torch.testing.assert_close(r, torch.tensor([[0.0, 0.05, 0.05, 0.2, 0.4]]) / 0.7)  # m* = 0: only x zeroed


def test_relaxed_greedy():
    p = torch.tensor([[[0.3, 0.1, 0.25, 0.35], [0.25, 0.25, 0.25, 0.25]]])
    nb = torch.tensor([[2, 1, 3], [0, 2, 3], [0, 1, 3], [2, 1, 0]])
    drafts = torch.tensor([[0]])
    out = verify_relaxed(drafts, p, neighbours=nb, delta=0.3, greedy=True, generator=None)
    assert out.num_accepted.item() == 1  # p~(0) = 0.55 >= 0.35
    out = verify_relaxed(drafts, p, neighbours=nb, delta=0.01, greedy=True, generator=None)
    assert out.num_accepted.item() == 0 and out.tokens[0, 0] == 3
