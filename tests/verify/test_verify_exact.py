"""Exact chain rule (Leviathan / Chen) and greedy verification.

Proofs:
* exact enumeration (float64) through the verifier itself: every draft pair and accept/reject branch, with the
  verifier's draws scripted (coins chosen, sample uniforms bisected to the inverse-CDF boundaries), gives the law of
  the first two emitted tokens, equal to p(y1) p(y2 | y1) to 1e-9 -- for sampled and point-mass drafts;
* Monte Carlo through the public API (200k independent rows in one call, ragged num_draft): chi-square of the first
  token and of the first two tokens against the target law (p > 1e-4, fixed seeds);
* adversarial pairs (p == q, disjoint supports, one-hot q, peaked p / flat q, q = 0 where p > 0);
* greedy verification reproduces target-only argmax decoding.
"""

import pytest
import torch

import mmspec.random
from mmspec.verify import residual_probs, verify_exact, verify_greedy


V = 5
N_MC = 200_000


def _dirichlet(shape, gen, alpha=1.0, dtype=torch.float64):
    x = torch.empty(shape, dtype=dtype).exponential_(generator=gen) ** (1 / alpha)
    return x / x.sum(-1, keepdim=True)


def _ar_model(gen):
    """A 3-step AR target (p1, P2[x1], P3[x1, x2]) and a 2-step draft (q1, Q2[x1])."""
    p1, p2, p3 = _dirichlet((V,), gen), _dirichlet((V, V), gen), _dirichlet((V, V, V), gen)
    q1, q2 = _dirichlet((V,), gen, 0.7), _dirichlet((V, V), gen, 0.7)
    return p1, p2, p3, q1, q2


def _script_draws(monkeypatch, coins: torch.Tensor, uniforms: torch.Tensor) -> None:
    """Replace the verifier's random draws, in their documented order (the acceptance coins ``[B, K]``, then one
    uniform per row for the correction / bonus sample), by the given values. Every draw goes through
    `mmspec.random` (`rand` -> `_draw`), so this drives the verifier's own accept / resample code deterministically."""
    script = [coins, uniforms]

    def draw(fn, shape, generator, device, dtype, counts):
        value = script.pop(0)
        assert tuple(value.shape) == tuple(shape)
        return value.to(device=device, dtype=dtype)

    monkeypatch.setattr(mmspec.random, "_draw", draw)


def _emitted_law(monkeypatch, pairs, p_target, q_draft, coins, iterations=52):
    """Exact law of the token the verifier SAMPLES (correction or bonus) for each row, given scripted coins.

    Inverse-CDF sampling maps the uniform u to a token monotonically, so the probability of token y is the width of
    the u-interval mapping to y. Bisect every boundary ``b_y = sup{u: token(u) <= y}`` through `verify_exact` itself
    (all rows x boundaries in one batch; 52 halvings: exact to ~2e-16). Returns ``([A, V] law, accept_prob [A, K])``.
    """
    rows = len(pairs)
    rep = lambda t: None if t is None else t.repeat_interleave(V - 1, dim=0)  # noqa: E731  rows x boundaries
    y = torch.arange(V - 1).repeat(rows)  # boundary index of each repeated row
    lo, hi = torch.zeros(rows * (V - 1), dtype=torch.float64), torch.ones(rows * (V - 1), dtype=torch.float64)
    for _ in range(iterations):
        mid = (lo + hi) / 2
        _script_draws(monkeypatch, rep(coins), mid[:, None])
        res = verify_exact(rep(pairs), rep(p_target), rep(q_draft), generator=None)
        token = res.tokens.gather(1, res.num_accepted[:, None]).squeeze(1)  # the sampled token
        below = token <= y
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    cdf = torch.cat([torch.zeros(rows, 1), lo.view(rows, V - 1), torch.ones(rows, 1)], 1).double()
    return cdf.diff(dim=1), res.accept_prob[:: V - 1]


@pytest.mark.parametrize("point_mass", [False, True])
def test_exact_enumeration_first_two_tokens(point_mass, make_generator, monkeypatch):
    """Every draft pair, every accept/reject branch, and the law of the resampled token, all from `verify_exact`'s
    own code (scripted coins, bisected sample uniforms): the first two emitted tokens are exactly p(y1) p(y2 | y1)."""
    p1, p2, p3, q1, q2 = _ar_model(make_generator(0))
    if point_mass:  # deterministic drafter: x1 = 3, x2 = f(x1)
        pairs = torch.tensor([[3, 1]])
        weight = torch.ones(1, dtype=torch.float64)
        q_draft = None
    else:
        grid = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # all (x1, x2)
        pairs, weight = grid, q1[grid[:, 0]] * q2[grid[:, 0], grid[:, 1]]
        q_draft = torch.stack([q1.expand(len(grid), V), q2[grid[:, 0]]], dim=1)
    x1, x2 = pairs[:, 0], pairs[:, 1]
    p_target = torch.stack([p1.expand(len(pairs), V), p2[x1], p3[x1, x2]], dim=1)  # [A, 3, V]
    ones, zeros = torch.ones(len(pairs), 2), torch.zeros(len(pairs), 2)
    # coins 1 reject (accept iff coin < a <= 1), coins 0 accept (a > 0; branches with a = 0 get weight 0 below)
    law_r1, accept = _emitted_law(monkeypatch, pairs, p_target, q_draft, ones)  # rejected at 1: correction y1
    law_r2, _ = _emitted_law(monkeypatch, pairs, p_target, q_draft, torch.stack([zeros[:, 0], ones[:, 1]], 1))
    a1, a2 = accept[:, 0], accept[:, 1]
    joint = torch.zeros(V, V, dtype=torch.float64)
    for i in range(len(pairs)):
        w = weight[i]
        joint[x1[i], x2[i]] += w * a1[i] * a2[i]  # both accepted
        joint[x1[i]] += w * a1[i] * (1 - a2[i]) * law_r2[i]  # x1 accepted, correction at 2
        joint += w * (1 - a1[i]) * law_r1[i][:, None] * p2  # correction at 1, next round draws p(. | y1)
    target = p1[:, None] * p2
    assert torch.allclose(joint, target, atol=1e-9, rtol=0)
    assert abs(float(joint.sum()) - 1) < 1e-9


def _draw(probs, gen):
    return torch.multinomial(probs.float(), 1, generator=gen).squeeze(-1)


@pytest.mark.parametrize("point_mass", [False, True])
def test_monte_carlo_first_two_tokens_ragged(point_mass, make_generator, chi2_pvalue):
    gen = make_generator(10 + point_mass)
    p1, p2, p3, q1, q2 = (t.float() for t in _ar_model(make_generator(2)))
    x1 = _draw(q1.expand(N_MC, V), gen)
    x2 = _draw(q2[x1], gen)
    if point_mass:
        x1 = torch.full((N_MC,), 3)
        x2 = (x1 + 1) % V
    drafts = torch.stack([x1, x2], dim=1)
    num_draft = torch.randint(0, 3, (N_MC,), generator=gen)  # ragged: 0, 1 or 2 valid drafts per row
    drafts = torch.where(torch.arange(2) < num_draft[:, None], drafts, -1)
    p_target = torch.stack([p1.expand(N_MC, V), p2[x1], p3[x1, x2]], dim=1)
    q_draft = None if point_mass else torch.stack([q1.expand(N_MC, V), q2[x1]], dim=1)
    res = verify_exact(drafts, p_target, q_draft, generator=gen, num_draft=num_draft)
    assert (res.num_accepted <= num_draft).all()
    y1 = res.tokens[:, 0]
    y2 = torch.where(res.num_accepted >= 1, res.tokens[:, 1], _draw(p2[y1], gen))  # next round if rejected
    assert chi2_pvalue(y1, p1) > 1e-4
    assert chi2_pvalue(y1 * V + y2, (p1[:, None] * p2).flatten()) > 1e-4


CASES = ["equal", "disjoint", "one_hot_q", "peaked_p_flat_q", "q_zero_where_p_positive", "p_one_hot"]


@pytest.mark.parametrize("case", CASES)
def test_monte_carlo_adversarial_pairs(case, make_generator, chi2_pvalue):
    gen = make_generator(100 + CASES.index(case))
    p = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])
    q = {
        "equal": p,
        "disjoint": torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0]),
        "one_hot_q": torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]),
        "peaked_p_flat_q": torch.full((V,), 0.2),
        "q_zero_where_p_positive": torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0]),
        "p_one_hot": torch.full((V,), 0.2),
    }[case]
    if case == "peaked_p_flat_q":
        p = torch.tensor([0.96, 0.01, 0.01, 0.01, 0.01])
    if case == "p_one_hot":
        p = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0])
    x = _draw(q.expand(N_MC, V), gen)[:, None]
    res = verify_exact(x, p.expand(N_MC, 2, V), q.expand(N_MC, 1, V), generator=gen)
    assert not torch.isnan(res.accept_prob).any()
    assert chi2_pvalue(res.tokens[:, 0], p) > 1e-4
    if case == "equal":
        assert (res.num_accepted == 1).all()
        assert chi2_pvalue(res.tokens[:, 1], p) > 1e-4  # bonus from p_target[:, K]


def test_residual_fallback_and_point_mass():
    p = torch.tensor([[0.25, 0.25, 0.5]])
    torch.testing.assert_close(residual_probs(p, p), p)  # all-zero residual -> p, never NaN
    torch.testing.assert_close(residual_probs(p, None, torch.tensor([2])), torch.tensor([[0.5, 0.5, 0.0]]))
    torch.testing.assert_close(residual_probs(p, torch.tensor([[0.5, 0.0, 0.5]])), torch.tensor([[0.0, 1.0, 0.0]]))
    # point mass on the only supported token: residual has no mass -> falls back to p
    one = torch.tensor([[0.0, 1.0, 0.0]])
    torch.testing.assert_close(residual_probs(one, None, torch.tensor([1])), one)


def test_result_layout(make_generator):
    p = torch.tensor([0.1, 0.2, 0.3, 0.4]).expand(3, 4, 4)
    drafts = torch.tensor([[3, 3, 3], [3, 3, 3], [0, 1, 2]])
    res = verify_exact(drafts, p, None, generator=make_generator(0), num_draft=torch.tensor([3, 0, 2]))
    n = res.num_accepted
    assert torch.equal(res.num_emitted, n + 1)
    for b in range(3):
        assert torch.equal(res.tokens[b, : n[b]], drafts[b, : n[b]])
        assert 0 <= res.tokens[b, n[b]] < 4
        assert (res.tokens[b, n[b] + 1 :] == -1).all()
        assert torch.equal(res.accept_mask[b], torch.arange(3) < n[b])
    assert n[1] == 0 and n[2] <= 2


def test_greedy_matches_target_argmax_decoding(make_generator):
    gen = make_generator(5)
    logits = torch.randn(64, 5, 7, generator=gen)
    best = logits.argmax(-1)  # [B, K+1]
    drafts = best[:, :4].clone()
    flip = torch.rand(64, 4, generator=gen) < 0.3
    drafts[flip] = (drafts[flip] + 1) % 7
    num_draft = torch.randint(0, 5, (64,), generator=gen)
    res = verify_greedy(drafts, logits, num_draft=num_draft)
    torch.testing.assert_close(verify_greedy(drafts, logits.softmax(-1), num_draft).tokens, res.tokens)
    for b in range(64):
        n = 0
        while n < num_draft[b] and drafts[b, n] == best[b, n]:
            n += 1
        assert res.num_accepted[b] == n
        assert torch.equal(res.tokens[b, : n + 1], torch.cat([drafts[b, :n], best[b, n : n + 1]]))
