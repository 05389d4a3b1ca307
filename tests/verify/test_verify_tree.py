"""Tree verification (recursive rejection sampling over siblings).

Proofs:
* exact enumeration (float64): the law of the first two emitted tokens of a depth-2 tree with per-node target
  distributions equals p(y1) p(y2 | y1) to 1e-9, for deterministic children (with a duplicate), i.i.d. sampled
  children (all child assignments enumerated, duplicates included) and children sampled without replacement. The
  recursion is written in the test from the paper; the per-step acceptance / residual come from the library's
  `rejection_step`;
* Monte Carlo through `verify_tree` (200k rows in one call, ragged trees in one case): chi-square of the first two
  emitted tokens against p (p > 1e-4);
* greedy trees follow the argmax path; relaxed / grouped acceptance with a singleton neighbourhood is identical to
  exact acceptance (same seed); the result layout (path, tokens, masks) is consistent.
"""

import itertools

import pytest
import torch

from mmspec.verify import codebook_neighbours, rejection_step, verify_tree


V = 5
N_MC = 200_000
# root -> A (0), B (1), C (2); A -> D (3), E (4)
PARENTS = [-1, -1, -1, 0, 0]


def _dirichlet(shape, gen, alpha=1.0):
    x = torch.empty(shape, dtype=torch.float64).exponential_(generator=gen) ** (1 / alpha)
    return x / x.sum(-1, keepdim=True)


def _model(seed):
    gen = torch.Generator().manual_seed(seed)
    p1, p2, p3 = _dirichlet((V,), gen), _dirichlet((V, V), gen), _dirichlet((V, V, V), gen)
    q1, q2 = _dirichlet((V,), gen, 0.6), _dirichlet((V, V), gen, 0.6)
    return p1, p2, p3, q1, q2


def _conditional(q, removed):
    """q restricted to tokens not in ``removed`` (bool [A, V]), renormalised: without-replacement sibling law."""
    w = q.masked_fill(removed, 0.0)
    return w / w.sum(-1, keepdim=True)


def _sibling_law(r, q_rows, toks, mode):
    """Law of the token emitted at a node: siblings tried in order, then the residual.

    r: [A, V] target at the node; q_rows: list of [A, V] (or None); toks: list of [A] child tokens.
    Returns (list of acceptance-path weights per child [A], final residual weight [A], residual [A, V]).
    """
    reach = torch.ones(r.shape[0], dtype=r.dtype)
    removed = torch.zeros(r.shape, dtype=torch.bool)
    accepted = []
    for q, x in zip(q_rows, toks):
        qc = None if mode == "deterministic" else (_conditional(q, removed) if mode == "without_replacement" else q)
        a, r_next = rejection_step(r, qc, x)
        accepted.append(reach * a)
        reach = reach * (1 - a)
        r = r_next
        removed[torch.arange(len(x)), x] = True
    return accepted, reach, r


def _enumerate_assignments(mode, p1, p2, q1, q2, fixed):
    """All child-token assignments (A, B, C, D, E) with their probabilities."""
    if mode == "deterministic":
        return torch.tensor([fixed]), torch.ones(1, dtype=torch.float64)
    rows, weights = [], []
    for a, b, c in itertools.product(range(V), repeat=3):
        if mode == "without_replacement":
            if len({a, b, c}) < 3:
                continue
            w_root = q1[a] * q1[b] / (1 - q1[a]) * q1[c] / (1 - q1[a] - q1[b])
        else:
            w_root = q1[a] * q1[b] * q1[c]
        for d, e in itertools.product(range(V), repeat=2):
            if mode == "without_replacement":
                if d == e:
                    continue
                w_a = q2[a, d] * q2[a, e] / (1 - q2[a, d])
            else:
                w_a = q2[a, d] * q2[a, e]
            rows.append([a, b, c, d, e])
            weights.append(w_root * w_a)
    return torch.tensor(rows), torch.stack(weights)


def _first_two_law(mode, seed):
    p1, p2, p3, q1, q2 = _model(seed)
    tok, w = _enumerate_assignments(mode, p1, p2, q1, q2, fixed=[2, 2, 0, 1, 3])  # duplicate root children
    n = len(tok)
    qroot = [q1.expand(n, V)] * 3
    acc_root, reach_root, r_root = _sibling_law(p1.expand(n, V), qroot, [tok[:, 0], tok[:, 1], tok[:, 2]], mode)
    # law of the second token given child A / B / C was accepted at depth 1
    a_tok = tok[:, 0]
    acc_a, reach_a, r_a = _sibling_law(p2[a_tok], [q2[a_tok]] * 2, [tok[:, 3], tok[:, 4]], mode)
    law_after_a = reach_a[:, None] * r_a
    for weight, x in zip(acc_a, [tok[:, 3], tok[:, 4]]):
        law_after_a = law_after_a + weight[:, None] * torch.nn.functional.one_hot(x, V)
    joint = torch.zeros(n, V, V, dtype=torch.float64)
    rows = torch.arange(n)
    joint[rows, a_tok] += acc_root[0][:, None] * law_after_a
    joint[rows, tok[:, 1]] += acc_root[1][:, None] * p2[tok[:, 1]]  # B, C are leaves: bonus ~ p(. | child)
    joint[rows, tok[:, 2]] += acc_root[2][:, None] * p2[tok[:, 2]]
    joint += reach_root[:, None, None] * r_root[:, :, None] * p2[None]  # no child accepted: next round
    return (w[:, None, None] * joint).sum(0), p1[:, None] * p2


@pytest.mark.parametrize("mode", ["deterministic", "iid", "without_replacement"])
def test_exact_enumeration_first_two_tokens(mode):
    law, target = _first_two_law(mode, seed=3)
    assert torch.allclose(law, target, atol=1e-9, rtol=0)


def _draw(probs, gen, num=1, replacement=True):
    return torch.multinomial(probs.float(), num, replacement=replacement, generator=gen)


@pytest.mark.parametrize("mode", ["deterministic", "iid", "without_replacement"])
def test_monte_carlo_first_two_tokens(mode, make_generator, chi2_pvalue):
    gen = make_generator(20 + ["deterministic", "iid", "without_replacement"].index(mode))
    p1, p2, p3, q1, q2 = (t.float() for t in _model(4))
    if mode == "deterministic":
        tok = torch.tensor([2, 2, 0, 1, 3]).expand(N_MC, 5)
    else:
        wr = mode == "iid"
        root = _draw(q1.expand(N_MC, V), gen, 3, replacement=wr)
        kids = _draw(q2[root[:, 0]], gen, 2, replacement=wr)
        tok = torch.cat([root, kids], dim=1)
    a = tok[:, 0]
    p_target = torch.stack(
        [p1.expand(N_MC, V), p2[a], p2[tok[:, 1]], p2[tok[:, 2]], p3[a, tok[:, 3]], p3[a, tok[:, 4]]], 1
    )
    q_draft = None
    if mode != "deterministic":
        q_draft = torch.stack([q1.expand(N_MC, V)] * 3 + [q2[a], q2[a]], dim=1)
    res = verify_tree(tok, torch.tensor(PARENTS), p_target, q_draft, mode=mode, generator=gen)
    y1 = res.tokens[:, 0]
    y2 = torch.where(res.num_accepted >= 1, res.tokens[:, 1], _draw(p2[y1], gen).squeeze(-1))
    assert chi2_pvalue(y1, p1) > 1e-4
    assert chi2_pvalue(y1 * V + y2, (p1[:, None] * p2).flatten()) > 1e-4


@pytest.mark.parametrize("mode", ["deterministic", "iid"])
def test_monte_carlo_per_row_generators_with_bounds(mode, make_generator, chi2_pvalue):
    """Per-row generators with host-known bounds: each row draws its whole grid of coins (no walk); the law of the
    first two tokens is still the target's."""
    n = 20_000
    gen = make_generator(40)
    gens = [make_generator(10_000 + i) for i in range(n)]
    p1, p2, p3, q1, q2 = (t.float() for t in _model(6))
    if mode == "deterministic":
        tok = torch.tensor([2, 2, 0, 1, 3]).expand(n, 5)
    else:
        root = _draw(q1.expand(n, V), gen, 3)
        tok = torch.cat([root, _draw(q2[root[:, 0]], gen, 2)], dim=1)
    a = tok[:, 0]
    p_target = torch.stack(
        [p1.expand(n, V), p2[a], p2[tok[:, 1]], p2[tok[:, 2]], p3[a, tok[:, 3]], p3[a, tok[:, 4]]], 1
    )
    q_draft = None if mode == "deterministic" else torch.stack([q1.expand(n, V)] * 3 + [q2[a], q2[a]], dim=1)
    res = verify_tree(tok, torch.tensor(PARENTS), p_target, q_draft, mode=mode, generator=gens, bounds=(2, 3))
    y1 = res.tokens[:, 0]
    y2 = torch.where(res.num_accepted >= 1, res.tokens[:, 1], _draw(p2[y1], gen).squeeze(-1))
    assert chi2_pvalue(y1, p1) > 1e-4
    assert chi2_pvalue(y1 * V + y2, (p1[:, None] * p2).flatten()) > 1e-4
    with pytest.raises(ValueError, match="below the tree's depth"):  # a tree deeper than its bounds is refused
        verify_tree(tok[:2], torch.tensor(PARENTS), p_target[:2], None if q_draft is None else q_draft[:2], mode=mode,
                    generator=gens[:2], bounds=(1, 3))  # fmt: skip


def test_monte_carlo_ragged_trees_per_row_parents(make_generator, chi2_pvalue):
    """Per-row parents and absent nodes (-1): chain rows, bushy rows and empty trees in one batch."""
    gen = make_generator(30)
    p1, p2, p3, q1, q2 = (t.float() for t in _model(5))
    shapes = torch.tensor([[-1, -1, -1, 0, 0], [-1, 0, 1, 2, 3], [-1, -1, 0, 0, 1]])
    kind = torch.randint(0, 3, (N_MC,), generator=gen)
    parents = shapes[kind]
    tok = torch.randint(0, V, (N_MC, 5), generator=gen)
    absent = torch.rand(N_MC, 5, generator=gen) < 0.2
    # absent nodes take their subtree with them
    for i in range(5):
        par = parents[:, i]
        absent[:, i] |= (par >= 0) & absent.gather(1, par.clamp(min=0)[:, None]).squeeze(1)
    tok = torch.where(absent, -1, tok)
    # per-node target: p(. | path tokens); depth <= 4 here, use p2 for depth 1, p3 for depth >= 2 (any table works)
    ctx_first = torch.zeros(N_MC, 5, dtype=torch.long)
    p_nodes = []
    for i in range(5):
        par = parents[:, i]
        first = torch.where(par < 0, tok[:, i].clamp(min=0), ctx_first.gather(1, par.clamp(min=0)[:, None]).squeeze(1))
        ctx_first[:, i] = first
        p_nodes.append(torch.where((par < 0)[:, None], p2[tok[:, i].clamp(min=0)], p3[first, tok[:, i].clamp(min=0)]))
    p_target = torch.stack([p1.expand(N_MC, V)] + p_nodes, dim=1)
    res = verify_tree(tok, parents, p_target, generator=gen)
    y1 = res.tokens[:, 0]
    y2 = torch.where(res.num_accepted >= 1, res.tokens[:, 1], _draw(p2[y1], gen).squeeze(-1))
    assert chi2_pvalue(y1, p1) > 1e-4
    assert chi2_pvalue(y1 * V + y2, (p1[:, None] * p2).flatten()) > 1e-4
    assert not res.accept_mask[absent].any()


def test_layout_and_greedy(make_generator):
    gen = make_generator(7)
    batch = 32
    logits = torch.randn(batch, 6, V, generator=gen)
    best = logits.argmax(-1)
    tok = torch.randint(0, V, (batch, 5), generator=gen)
    tok[:16, 1] = best[:16, 0]  # node B matches the root argmax in half of the rows
    res = verify_tree(tok, torch.tensor(PARENTS), logits, generator=gen, greedy=True)
    for b in range(batch):
        node = next((i for i in range(3) if tok[b, i] == best[b, 0]), None)
        if node is None:
            assert res.num_accepted[b] == 0 and res.tokens[b, 0] == best[b, 0]
            continue
        assert res.path[b, 1] == node + 1 and res.tokens[b, 0] == tok[b, node]
        if node == 0:
            kid = next((i for i in (3, 4) if tok[b, i] == best[b, 1]), None)
            if kid is not None:
                assert res.num_accepted[b] == 2 and res.path[b, 2] == kid + 1
                assert res.tokens[b, 2] == best[b, kid + 1]
                continue
            assert res.num_accepted[b] == 1 and res.tokens[b, 1] == best[b, 1]
        else:
            assert res.num_accepted[b] == 1 and res.tokens[b, 1] == best[b, node + 1]
    probs = logits.softmax(-1)
    out = verify_tree(tok, torch.tensor(PARENTS), probs, generator=gen)
    assert out.path.shape == (batch, 3) and out.tokens.shape == (batch, 3)
    assert (out.path[:, 0] == 0).all()
    assert torch.equal(out.accept_mask.sum(-1), out.num_accepted)
    tried = ~torch.isnan(out.accept_prob)
    assert tried[:, 0].all()  # the first root child is always tried
    for b in range(batch):
        n = int(out.num_accepted[b])
        assert (out.tokens[b, n + 1 :] == -1).all() and 0 <= out.tokens[b, n] < V
        assert torch.equal(out.tokens[b, :n], tok[b, out.path[b, 1 : n + 1] - 1])


@pytest.mark.parametrize("mode", ["deterministic", "without_replacement"])
def test_singleton_relaxation_equals_exact_tree(mode, make_generator):
    gen = make_generator(8)
    batch = 2000
    p_target = torch.rand(batch, 6, V, generator=gen).softmax(-1)
    q_draft = torch.rand(batch, 5, V, generator=gen).softmax(-1) if mode != "deterministic" else None
    tok = torch.stack([torch.randperm(V, generator=gen)[:3] for _ in range(batch)])
    tok = torch.cat([tok, torch.stack([torch.randperm(V, generator=gen)[:2] for _ in range(batch)])], 1)
    nb = codebook_neighbours(torch.randn(V, 3, generator=gen), 3)
    args = (tok, torch.tensor(PARENTS), p_target, q_draft)
    exact = verify_tree(*args, mode=mode, generator=make_generator(9))
    for knobs in [
        {"acceptance": "relaxed", "neighbours": nb, "k": 0, "delta": 0.3},
        {"acceptance": "relaxed", "neighbours": nb, "delta": 0.0},
        {"acceptance": "grouped", "group_size": 1},
        {"acceptance": "grouped", "delta": 0.0},
    ]:
        other = verify_tree(*args, mode=mode, generator=make_generator(9), **knobs)
        assert torch.equal(other.tokens, exact.tokens), knobs
        assert torch.equal(other.path, exact.path), knobs


def test_relaxed_tree_accepts_at_least_first_child_as_often(make_generator):
    """Relaxed acceptance of the first root child is pointwise >= exact on the same coins."""
    gen = make_generator(11)
    batch = 5000
    p_target = torch.rand(batch, 6, V, generator=gen).softmax(-1)
    tok = torch.randint(0, V, (batch, 5), generator=gen)
    nb = codebook_neighbours(torch.randn(V, 3, generator=gen), 4)
    args = (tok, torch.tensor(PARENTS), p_target)
    exact = verify_tree(*args, generator=make_generator(12))
    relaxed = verify_tree(*args, generator=make_generator(12), acceptance="relaxed", neighbours=nb, delta=0.2)
    assert (relaxed.accept_prob[:, 0] >= exact.accept_prob[:, 0]).all()
    assert (relaxed.path[:, 1] == 1).sum() >= (exact.path[:, 1] == 1).sum()
    assert (relaxed.accept_mask[:, 0] | ~exact.accept_mask[:, 0]).all()
    assert relaxed.num_accepted.float().mean() > exact.num_accepted.float().mean()
