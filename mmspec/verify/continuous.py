"""Continuous speculative decoding for diffusion-head tokens (CSpD, Wang et al., arXiv 2411.11925).

Release: MarkXCloud/CSpD (``spec_decode/spec_decode_runner.py``). Continuous-token AR models (MAR) sample each token
with a small diffusion head; with aligned noise for draft and target (same ``x_T`` and per-step noise) the last
denoising step is Gaussian for both, ``q_draft = N(draft_mean, draft_std^2)`` and
``p_target = N(target_mean, target_std^2)`` (diagonal), so the density ratio of the exact rule is available in
closed form. The residual ``norm([p - q a]_+)`` has no closed form and is sampled by acceptance-rejection.
"""

import logging

import torch
from torch import Tensor

from mmspec.random import Generators, check_generator, num_rows, rand, randn
from mmspec.sampling import prob_dtype
from mmspec.verify.checks import Checks, check_shape, num_draft_mask
from mmspec.verify.results import ContinuousResult


logger = logging.getLogger(__name__)

__all__ = ["verify_continuous"]

# residual proposals per rejected token drawn before the first host read: with the default `max_residual_tries`
# (100) every proposal is drawn at once, for every position, so a verification reads nothing on the host; a larger
# bound continues in chunks of `RESIDUAL_CHUNK`, one read each (whether a position is still without a value)
RESIDUAL_TRIES_AT_ONCE = 128
RESIDUAL_CHUNK = 16


def _gauss_logpdf(x: Tensor, mean: Tensor, std: Tensor, temperature: float = 1.0) -> Tensor:
    """Diagonal Gaussian log-density summed over the last dim, up to ``-D/2 log(2 pi)``; ``temperature`` widens
    only the exponent (the CSpD release's inner temperature)."""
    z = (x - mean) / (std * temperature)
    return -0.5 * z.pow(2).sum(-1) - std.log().sum(-1)


def _try_draws(tries: int, shape: tuple, generator, counts: Tensor, dtype, device) -> tuple[Tensor, Tensor]:
    """Residual proposals: standard normals ``[tries, B, K, D]`` and uniforms ``[tries, B, K]``.

    One generator: drawn tries-first (normals, then uniforms). Per-row generators: row b draws its first
    ``counts[b]`` positions' ``tries`` proposals, position-major, so its draws do not depend on other rows.
    """
    batch, k, d = shape
    if num_rows(generator) is None:
        z = randn((tries, *shape), generator, device=device, dtype=dtype)
        u = rand((tries, batch, k), generator, device=device, dtype=dtype)
        return z, u
    z = randn((batch, k, tries, d), generator, device=device, dtype=dtype, counts=counts).permute(2, 0, 1, 3)
    u = rand((batch, k, tries), generator, device=device, dtype=dtype, counts=counts).permute(2, 0, 1)
    return z, u


def verify_continuous(
    draft_values: Tensor,
    target_mean: Tensor,
    target_std: Tensor,
    draft_mean: Tensor,
    draft_std: Tensor,
    *,
    generator: Generators,
    log_ratio_offset: Tensor | None = None,
    inner_temperature: float = 1.0,
    max_residual_tries: int = 100,
    prefix: bool = True,
    num_draft: Tensor | None = None,
    validate: bool = True,
) -> ContinuousResult:
    """CSpD verification of continuous drafts (module docstring).

    Accept draft ``x`` with ``min(1, p(x)/q(x) * exp(log_ratio_offset))``, computed in log space. On rejection
    sample ``norm([p - q a]_+)`` (= ``norm([p - q]_+)`` for the exact rule) by acceptance-rejection with proposal p:
    accept ``z ~ p`` with probability ``[1 - q(z) a(z) / p(z)]_+``, up to ``max_residual_tries``; a token never
    accepted falls back to a plain sample from p (the release leaves it at zero) and is counted in
    ``num_fallbacks``. With ``inner_temperature=1`` and no offset the output is exactly distributed as p.

    ``inner_temperature`` (release: 42) widens both Gaussians in the acceptance exponent only (the normalisers
    keep the true std), a heuristic that makes near-deterministic last steps comparable; ``log_ratio_offset``
    adds a per-token trajectory term (the release's ``sum_t log sigma`` difference over the earlier steps).

    ``prefix=True``: AR order, stop at the first rejection (emit the residual sample there; no bonus token since
    the target produced no extra sample). ``prefix=False``: every token is checked independently and every valid
    position is emitted (accepted draft or residual sample), as the CSpD release does for MAR blocks.

    RNG: the acceptance uniforms ``[B, K]``; then the first ``min(max_residual_tries, RESIDUAL_TRIES_AT_ONCE)``
    proposals for every position (`_try_draws`), drawn before any host read; past them, while a row has a
    rejected position without a residual sample, chunks of ``RESIDUAL_CHUNK`` (a finished row draws nothing
    more); then the fallback normals ``[B, K, D]``. With per-row generators row b draws only for its
    ``num_draft[b]`` positions. Host reads: none with ``max_residual_tries <= RESIDUAL_TRIES_AT_ONCE`` (the
    default) and every row at K drafts or one generator; else the rows' counts once and one per further chunk.

    Args:
        draft_values: ``[B, K, D]`` draft samples x.
        target_mean, target_std, draft_mean, draft_std: ``[B, K, D]`` last-step Gaussian parameters (std > 0).
        generator: source of every random draw (one ``torch.Generator`` or one per row, see `verify_chain`).
        log_ratio_offset: ``[B, K]`` added to the log acceptance ratio (None = 0).
        inner_temperature: exponent temperature (1 = exact).
        max_residual_tries: proposals per rejected token before the fallback.
        prefix: AR prefix acceptance (True) or independent per-token acceptance (False).
        num_draft: ``[B]`` valid drafts per row.
        validate: value checks (one host sync).

    Returns:
        `ContinuousResult`: ``values [B, K, D]`` (emitted values at positions ``< num_emitted``, NaN after),
        ``accept_mask [B, K]``, ``num_accepted`` (prefix: accepted prefix length; else accepted count),
        ``num_emitted``, ``num_fallbacks [B]``, ``accept_prob [B, K]``; ``tokens`` is None.
    """
    if not isinstance(draft_values, Tensor) or draft_values.ndim != 3:
        shape = tuple(draft_values.shape) if isinstance(draft_values, Tensor) else type(draft_values).__name__
        raise ValueError(f"draft_values must be [B, K, D], got shape {shape}")
    shape = tuple(draft_values.shape)
    for name, t in [
        ("target_mean", target_mean),
        ("target_std", target_std),
        ("draft_mean", draft_mean),
        ("draft_std", draft_std),
    ]:
        check_shape(name, t, shape)
    if max_residual_tries < 1:
        raise ValueError(f"max_residual_tries must be >= 1, got {max_residual_tries}")
    if not inner_temperature > 0:
        raise ValueError(f"inner_temperature must be > 0, got {inner_temperature}")
    batch, k, _ = shape
    check_generator(generator, batch, draft_values.device)
    dtype = prob_dtype(draft_values.dtype)
    x, mu_p, sd_p, mu_q, sd_q = (t.to(dtype) for t in (draft_values, target_mean, target_std, draft_mean, draft_std))
    offset = torch.zeros(batch, k, dtype=dtype, device=x.device)
    if log_ratio_offset is not None:
        check_shape("log_ratio_offset", log_ratio_offset, (batch, k))
        offset = log_ratio_offset.to(dtype)
    lengths, valid = num_draft_mask(num_draft, batch, k, x.device)
    if validate:
        checks = Checks()
        for name, t in [("draft_values", x), ("target_mean", mu_p), ("draft_mean", mu_q)]:
            checks.add(~torch.isfinite(t).all(), f"{name} must be finite")
        for name, t in [("target_std", sd_p), ("draft_std", sd_q)]:
            checks.add(~(t > 0).all(), f"{name} must be > 0 (and not NaN)")
        checks.add(((lengths < 0) | (lengths > k)).any(), f"num_draft must be in [0, {k}]")
        checks.run()

    def log_ratio(z: Tensor) -> Tensor:  # acceptance log-ratio at z  [..., B, K]
        return (
            _gauss_logpdf(z, mu_p, sd_p, inner_temperature) - _gauss_logpdf(z, mu_q, sd_q, inner_temperature) + offset
        )

    accept_prob = torch.where(valid, log_ratio(x).clamp_max(0).exp(), 0.0)  # [B, K]
    # per-row generators: the rows' draw counts on the host (known without a read when every row has K drafts)
    if num_rows(generator) is None:
        counts = lengths
    else:
        counts = [k] * batch if num_draft is None else lengths.tolist()
    coins = rand((batch, k), generator, device=x.device, dtype=dtype, counts=counts)
    accepted = (coins < accept_prob) & valid  # [B, K]
    if prefix:
        n = accepted.long().cumprod(-1).sum(-1)
        pos = torch.arange(k, device=x.device)
        need = (pos == n[:, None]) & valid  # the first rejected position  [B, K]
        accept_mask = pos < n[:, None]
        num_emitted = torch.minimum(n + 1, lengths)
    else:
        n = accepted.sum(-1)
        need = valid & ~accepted
        accept_mask = accepted
        num_emitted = lengths

    # Residual by acceptance-rejection with proposal p: accept z w.p. [1 - q(z) a(z) / p(z)]_+ (G* for a). The first
    # `RESIDUAL_TRIES_AT_ONCE` proposals are drawn for every valid position before anything is read (a position that
    # needs none discards its own); later chunks only while a position is left without a value (one read each).
    resid = torch.zeros_like(x)
    filled = ~need
    tries, left = 0, [True] * batch
    while tries < max_residual_tries and any(left):
        c = min(RESIDUAL_TRIES_AT_ONCE if tries == 0 else RESIDUAL_CHUNK, max_residual_tries - tries)
        # per-row generators: rows with nothing left draw nothing
        left_counts = [c_row if row_left else 0 for c_row, row_left in zip(counts, left, strict=True)] if isinstance(
            counts, list) else None  # fmt: skip
        noise, uniforms = _try_draws(c, shape, generator, left_counts, dtype, x.device)
        z = mu_p + sd_p * noise  # [c, B, K, D]
        lq_lp = _gauss_logpdf(z, mu_q, sd_q) - _gauss_logpdf(z, mu_p, sd_p)  # exact densities  [c, B, K]
        take_prob = (1 - (lq_lp + log_ratio(z).clamp_max(0)).exp()).clamp_min(0)
        ok = uniforms < take_prob
        first = ok.long().argmax(0)  # [B, K] first accepted try
        pick = z.gather(0, first[None, ..., None].expand(1, *shape)).squeeze(0)  # [B, K, D]
        take = ~filled & ok.any(0)
        resid = torch.where(take[..., None], pick, resid)
        filled = filled | take
        tries += c
        if tries < max_residual_tries:
            left = (~filled).any(-1).tolist()  # one host read per further chunk: rows with a position left
    fallback = ~filled  # [B, K]
    plain = mu_p + sd_p * randn(shape, generator, device=x.device, dtype=dtype, counts=counts)
    resid = torch.where(fallback[..., None], plain, resid)
    num_fallbacks = fallback.sum(-1)
    if logger.isEnabledFor(logging.DEBUG) and bool(fallback.any()):
        logger.debug("verify_continuous: %d residual samples fell back to plain target samples", int(fallback.sum()))

    values = torch.where(accepted[..., None], x, resid)
    emitted = torch.arange(k, device=x.device) < num_emitted[:, None]
    values = torch.where(emitted[..., None], values, float("nan"))
    return ContinuousResult(
        num_accepted=n,
        accept_mask=accept_mask,
        tokens=None,
        values=values,
        accept_prob=accept_prob,
        num_emitted=num_emitted,
        num_fallbacks=num_fallbacks,
    )
