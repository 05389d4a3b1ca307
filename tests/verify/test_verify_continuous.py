"""Continuous speculative decoding (CSpD): density-ratio acceptance + residual acceptance-rejection.

Proofs: with known Gaussian p and q (1-D and 2-D, diagonal) the emitted values are distributed as p (KS tests on
marginals and a projection, p > 1e-4, plus moments); the acceptance probability equals min(1, p(x)/q(x)) (with the
inner-temperature / offset variants matching their formulas); the fallback fires when the residual is tiny (p ~ q,
one try) and never emits zeros or NaN; prefix vs per-token layouts.
"""

import math

import pytest
import torch
from scipy import stats

from mmspec.verify import verify_continuous


N = 100_000


def _gauss(gen, mean, std, shape):
    return mean + std * torch.randn(shape, generator=gen, dtype=torch.float64)


def test_one_dimensional_output_is_target(make_generator):
    gen = make_generator(0)
    shape = (N, 1, 1)
    mu_p, sd_p, mu_q, sd_q = 0.0, 1.0, 0.8, 0.7
    x = _gauss(gen, mu_q, sd_q, shape)
    full = lambda v: torch.full(shape, v, dtype=torch.float64)  # noqa: E731
    res = verify_continuous(x, full(mu_p), full(sd_p), full(mu_q), full(sd_q), generator=gen)
    y = res.values[:, 0, 0].numpy()
    assert stats.kstest(y, stats.norm(mu_p, sd_p).cdf).pvalue > 1e-4
    assert 0.2 < float(res.num_accepted.double().mean()) < 0.95
    # acceptance probability formula
    ref = stats.norm(mu_p, sd_p).logpdf(x[:, 0, 0].numpy()) - stats.norm(mu_q, sd_q).logpdf(x[:, 0, 0].numpy())
    torch.testing.assert_close(res.accept_prob[:, 0], torch.from_numpy(ref).clamp(max=0).exp())
    assert int(res.num_fallbacks.sum()) == 0


def test_two_dimensional_output_is_target(make_generator):
    gen = make_generator(1)
    shape = (N, 1, 2)
    mu_p, sd_p = torch.tensor([0.0, 1.0], dtype=torch.float64), torch.tensor([1.0, 0.5], dtype=torch.float64)
    mu_q, sd_q = torch.tensor([0.5, 0.8], dtype=torch.float64), torch.tensor([1.3, 0.6], dtype=torch.float64)
    x = mu_q + sd_q * torch.randn(shape, generator=gen, dtype=torch.float64)
    res = verify_continuous(
        x, mu_p.expand(shape), sd_p.expand(shape), mu_q.expand(shape), sd_q.expand(shape), generator=gen, prefix=False
    )
    y = res.values[:, 0]
    for d in range(2):
        assert stats.kstest(y[:, d].numpy(), stats.norm(float(mu_p[d]), float(sd_p[d])).cdf).pvalue > 1e-4
    proj = (y[:, 0] + y[:, 1]).numpy()  # independence: the sum is N(sum mu, sum var)
    assert stats.kstest(proj, stats.norm(float(mu_p.sum()), math.sqrt(float((sd_p**2).sum()))).cdf).pvalue > 1e-4
    cov = torch.cov(y.T)
    assert abs(float(cov[0, 1])) < 0.02
    torch.testing.assert_close(y.mean(0), mu_p, atol=0.02, rtol=0)


def test_prefix_layout_and_per_token_mode(make_generator):
    gen = make_generator(2)
    batch, k, d = 2000, 4, 3
    shape = (batch, k, d)
    mu_q = torch.randn(shape, generator=gen)
    x = mu_q + 0.5 * torch.randn(shape, generator=gen)
    mu_p = mu_q + 0.3
    ones = torch.ones(shape)
    num_draft = torch.randint(0, k + 1, (batch,), generator=gen)
    res = verify_continuous(x, mu_p, ones, mu_q, 0.5 * ones, generator=gen, num_draft=num_draft)
    n = res.num_accepted
    assert torch.equal(res.num_emitted, torch.minimum(n + 1, num_draft))
    emitted = torch.arange(k) < res.num_emitted[:, None]
    assert torch.isfinite(res.values[emitted]).all() and torch.isnan(res.values[~emitted]).all()
    accepted = torch.arange(k) < n[:, None]
    assert torch.equal(res.values[accepted], x[accepted])
    assert torch.equal(res.accept_mask, accepted)
    res = verify_continuous(x, mu_p, ones, mu_q, 0.5 * ones, generator=gen, prefix=False, num_draft=num_draft)
    valid = torch.arange(k) < num_draft[:, None]
    assert torch.equal(res.num_emitted, num_draft) and torch.equal(res.num_accepted, res.accept_mask.sum(-1))
    assert torch.isfinite(res.values[valid]).all()
    assert torch.equal(res.values[res.accept_mask], x[res.accept_mask])


def test_fallback_fires_when_residual_is_tiny_and_never_emits_zero(make_generator):
    gen = make_generator(3)
    shape = (5000, 2, 2)
    mu = torch.randn(shape, generator=gen) + 3.0
    sd = torch.full(shape, 0.5)
    x = mu + sd * torch.randn(shape, generator=gen)
    # p ~ q: residual mass ~ 1e-4, acceptance ~ 1; force rejections with a negative offset
    res = verify_continuous(
        x,
        mu + 1e-4,
        sd,
        mu,
        sd,
        generator=gen,
        log_ratio_offset=torch.full(shape[:2], -5.0),
        max_residual_tries=1,
        prefix=False,
    )
    assert int(res.num_fallbacks.sum()) > 0
    assert torch.isfinite(res.values).all() and (res.values != 0).all()


@pytest.mark.parametrize("temperature, offset", [(42.0, 0.0), (1.0, 0.7), (3.0, -0.4)])
def test_inner_temperature_and_offset_formula(temperature, offset, make_generator):
    gen = make_generator(4)
    shape = (64, 3, 4)
    mu_p, mu_q = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    sd_p, sd_q = torch.rand(shape, generator=gen) + 0.1, torch.rand(shape, generator=gen) + 0.1
    x = mu_q + sd_q * torch.randn(shape, generator=gen)
    res = verify_continuous(
        x,
        mu_p,
        sd_p,
        mu_q,
        sd_q,
        generator=gen,
        inner_temperature=temperature,
        log_ratio_offset=torch.full(shape[:2], offset),
        prefix=False,
    )
    z_p, z_q = (x - mu_p) / (sd_p * temperature), (x - mu_q) / (sd_q * temperature)
    log_ratio = (-0.5 * z_p**2 + 0.5 * z_q**2 - sd_p.log() + sd_q.log()).sum(-1) + offset
    torch.testing.assert_close(res.accept_prob, log_ratio.clamp(max=0).exp())


def test_residual_tries_past_the_first_draw_keep_the_law_and_read_once_per_chunk(make_generator):
    """The first `RESIDUAL_TRIES_AT_ONCE` proposals are drawn before any host read (none at the default bound);
    past them, chunks of `RESIDUAL_CHUNK` follow with one read each. A residual with ~1 % acceptance per proposal
    (p = N(0, 1), q = N(0.025, 1)) and drafts the rule rejects (x = 400, ratio ~ e^-10) sends ~28 % of positions
    past the first draw; run at bound 128 (those positions fall back) and at bound 1,000 (they go on in chunks) from
    the same seed: positions settled in the first draw are identical, and the ones settled later follow the
    residual law norm([p - q]_+) (KS against its CDF)."""
    from mmspec.counting import HostReads
    from mmspec.verify.continuous import RESIDUAL_CHUNK, RESIDUAL_TRIES_AT_ONCE

    n, delta = 4000, 0.025
    shape = (n, 1, 1)
    full = lambda v: torch.full(shape, v, dtype=torch.float64)  # noqa: E731
    args = (full(400.0), full(0.0), full(1.0), full(delta), full(1.0))
    runs = {}
    for bound in (RESIDUAL_TRIES_AT_ONCE, 1000):
        with HostReads() as reads:
            res = verify_continuous(
                *args, generator=make_generator(7), prefix=False, max_residual_tries=bound, validate=False
            )  # the pipeline's call: no value checks
        runs[bound] = res, reads.count
    (first, first_reads), (later, later_reads) = runs[RESIDUAL_TRIES_AT_ONCE], runs[1000]
    assert int(first.num_accepted.sum()) == 0  # every draft rejected: every value is a residual draw
    assert first_reads == 0
    assert 1 <= later_reads <= (1000 - RESIDUAL_TRIES_AT_ONCE) // RESIDUAL_CHUNK + 1
    past = first.num_fallbacks.bool()  # [N] positions without a value after the first draw
    assert 0.2 < float(past.double().mean()) < 0.35, float(past.double().mean())
    assert torch.equal(later.values[~past], first.values[~past])
    assert int(later.num_fallbacks.sum()) <= 3  # P(no value in 1,000 tries) ~ 1e-4 per position
    past = past & ~later.num_fallbacks.bool()
    # residual CDF: (Phi(z) - Phi(z - delta)) / (Phi(delta / 2) - Phi(-delta / 2)) for z <= delta / 2, then 1
    tv = stats.norm.cdf(delta / 2) - stats.norm.cdf(-delta / 2)

    def cdf(z):
        z = z.clip(max=delta / 2)
        return (stats.norm.cdf(z) - stats.norm.cdf(z - delta)) / tv

    assert stats.kstest(later.values[past, 0, 0].numpy(), cdf).pvalue > 1e-4
    assert stats.kstest(first.values[~past, 0, 0].numpy(), cdf).pvalue > 1e-4
