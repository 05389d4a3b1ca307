"""Chain verification: one engine for every acceptance rule, and the per-rule entry points.

Standard speculative sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318) over a
chain of K drafts ``x_1..x_K``, ``x_i ~ q_draft[:, i]``, with ``p_target[:, i]`` the target distribution at draft
position i and ``p_target[:, K]`` the bonus distribution:

    for i in 1..K:  accept x_i with probability a(x_i)  (the rule's `AcceptanceRule.accept`)
                    else emit y ~ the rule's residual at i (`AcceptanceRule.residual`) and STOP
    all accepted:   emit a bonus y ~ p_target[:, K]

`verify_chain` runs this for any `AcceptanceRule`, vectorised over batch and positions (one coin per position
drawn up front, then the first rejection). `verify_exact` / `verify_relaxed` / `verify_grouped` build their rule
and call it; `verify_greedy` is its deterministic form.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from mmspec.random import Generators, check_generator, rand
from mmspec.sampling import inverse_cdf, prob_dtype, sample
from mmspec.verify.checks import Checks, check_shape, check_tokens_and_probs, gather_last, num_draft_mask
from mmspec.verify.gsd import Grouped
from mmspec.verify.lantern import Lantern
from mmspec.verify.results import VerifyResult
from mmspec.verify.rules import AcceptanceRule, Exact


__all__ = [
    "chain_from_uniforms",
    "decide_chain",
    "verify_chain",
    "verify_exact",
    "verify_greedy",
    "verify_grouped",
    "verify_relaxed",
]


def safe_tokens(draft_tokens: Tensor, valid: Tensor, vocab: int) -> Tensor:
    """``draft_tokens [B, K]`` with the slots past a row's draft (``valid`` False) set to 0 and every id clamped into
    ``[0, vocab)``: safe for gathers, whatever a padded slot holds."""
    return torch.where(valid, draft_tokens, 0).clamp(0, vocab - 1)


def closes_with_bonus(num_accepted: Tensor, num_draft: Tensor | None, k: int) -> Tensor:
    """``[B]`` bool: a chain round closed with a token drawn from ``p_target`` itself (the bonus), i.e. every valid
    draft was accepted (``num_draft`` None: all ``k``) rather than a residual draw."""
    return num_accepted >= (k if num_draft is None else num_draft)


def chain_setup(
    draft_tokens: Tensor,
    p_target: Tensor,
    q_draft: Tensor | None,
    num_draft: Tensor | None,
    validate: bool,
    check_probs: bool = True,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor, Tensor, Checks]:
    """Shape checks + dtype promotion.

    Returns ``(p [B,K+1,V], q [B,K,V] | None, safe tokens [B,K], lengths [B], valid [B,K], pending value checks)``.
    ``check_probs=False`` (greedy decoding, which also takes logits) checks ``p_target`` for NaN only.
    """
    batch, k, vocab = check_tokens_and_probs("draft_tokens", draft_tokens, p_target, "K")
    p = p_target.to(prob_dtype(p_target.dtype))
    q = None
    if q_draft is not None:
        check_shape("q_draft", q_draft, (batch, k, vocab))
        q = q_draft.to(p.dtype)
    lengths, valid = num_draft_mask(num_draft, batch, k, p.device)
    checks = Checks()
    if validate:
        checks.add(((lengths < 0) | (lengths > k)).any(), f"num_draft must be in [0, {k}]")
        checks.tokens("draft_tokens", draft_tokens, vocab, valid)
        if check_probs:
            valid_p = torch.arange(k + 1, device=p.device) <= lengths[:, None]  # [B, K+1]
            checks.probs("p_target", p, valid_p, p_target.dtype)
            if q is not None:
                checks.probs("q_draft", q, valid, q_draft.dtype)
        else:
            checks.not_nan("p_target", p)
    tokens = safe_tokens(draft_tokens, valid, vocab)  # [B, K]
    if validate and check_probs and q is not None:
        checks.add(
            ((gather_last(q, tokens) <= 0) & valid).any(),
            "q_draft is 0 at a draft token (a draft cannot have been sampled from q_draft)",
        )
    return p, q, tokens, lengths, valid, checks


@dataclass
class ChainState:
    """What a chain verification computed on the way, for rules built on top of it (`verify_jacobi`'s re-draft).

    Attributes:
        p: ``[B, K+1, V]`` ``p_target`` in the probability dtype; q: ``[B, K, V]`` ``q_draft`` or None.
        tokens: ``[B, K]`` drafts (padding replaced by 0); lengths: ``[B]`` valid drafts per row.
        coins: ``[B, K]`` the acceptance uniforms (None for greedy decoding).
        accept_prob: ``[B, K]`` acceptance probabilities (0 at padding).
        num_accepted: ``[B]``.
    """

    p: Tensor
    q: Tensor | None
    tokens: Tensor
    lengths: Tensor
    coins: Tensor | None
    accept_prob: Tensor
    num_accepted: Tensor


def assemble_chain(
    draft_tokens: Tensor, num_accepted: Tensor, next_token: Tensor, accept_prob: Tensor
) -> VerifyResult:
    batch, k = draft_tokens.shape
    pos = torch.arange(k + 1, device=draft_tokens.device)  # [K+1]
    padded = torch.cat([draft_tokens, draft_tokens.new_full((batch, 1), -1)], dim=1)  # [B, K+1]
    n = num_accepted[:, None]
    tokens = torch.where(pos < n, padded, torch.where(pos == n, next_token[:, None], -1))
    return VerifyResult(
        num_accepted=num_accepted,
        accept_mask=pos[:k] < n,
        tokens=tokens,
        accept_prob=accept_prob,
    )


def decide_chain(
    rule: AcceptanceRule,
    p: Tensor,
    q: Tensor | None,
    tokens: Tensor,
    lengths: Tensor,
    valid: Tensor,
    coins: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The chain rule given its acceptance uniforms ``coins [B, K]`` (None: greedy decoding), a pure tensor function
    (no generator, no host read). ``p``, ``q``, ``tokens``, ``lengths``, ``valid``: as `chain_setup` returns them.

    Returns ``(accept_prob [B, K], num_accepted [B], dist [B, V])``: ``dist`` is what the next token is drawn from
    (the rule's residual at the first rejection, ``p_target`` past the last valid draft; greedy: ``p_target`` at
    the stop, whose argmax is the token)."""
    batch, k = tokens.shape
    rows = torch.arange(batch, device=p.device)
    if coins is None:
        accepted = rule.greedy_accept(p[:, :k], tokens) & valid
        accept_prob = accepted.to(p.dtype)
    else:
        accept_prob = torch.where(valid, rule.accept(p[:, :k], q, tokens), 0.0)  # [B, K]
        accepted = (coins < accept_prob) & valid
    n = accepted.long().cumprod(-1).sum(-1)  # [B] first rejection (prefix-closed)
    p_sel = p[rows, n]  # [B, V] target dist at the next position
    if coins is None or k == 0:
        return accept_prob, n, p_sel
    idx = n.clamp(max=k - 1)
    resid = rule.residual(p_sel, None if q is None else q[rows, idx], tokens[rows, idx])
    return accept_prob, n, torch.where((n >= lengths)[:, None], p_sel, resid)  # bonus if every valid draft accepted


def chain_from_uniforms(
    rule: AcceptanceRule,
    draft_tokens: Tensor,
    p_target: Tensor,
    q_draft: Tensor | None,
    num_draft: Tensor,
    uniforms: Tensor | None,
) -> VerifyResult:
    """`verify_chain` (unvalidated) as a pure tensor function of pre-drawn uniforms: what a captured graph runs
    (`mmspec.decoding.captured_verify`).

    ``uniforms [B, K+1]`` (float64; None: greedy decoding): ``uniforms[:, :K]`` are the acceptance coins,
    ``uniforms[:, K]`` the next token's draw by inverse CDF (`mmspec.sampling.inverse_cdf`) from the residual or
    the bonus distribution. The same law as `verify_chain` (a coin is compared with the acceptance probability in
    float64; the next token is the inverse CDF of its distribution at a uniform), another random stream: the coins
    and the draw come from the caller's one draw per generator. ``K = 0`` is plain AR decoding: one token from
    ``p_target[:, 0]``."""
    return run_chain_from_uniforms(rule, draft_tokens, p_target, q_draft, num_draft, uniforms)[0]


def run_chain_from_uniforms(
    rule: AcceptanceRule,
    draft_tokens: Tensor,
    p_target: Tensor,
    q_draft: Tensor | None,
    num_draft: Tensor,
    uniforms: Tensor | None,
) -> tuple[VerifyResult, ChainState]:
    """`chain_from_uniforms`, also returning its `ChainState` (as `run_chain` for `verify_chain`): for rules built
    on top of it (`mmspec.verify.jacobi.jacobi_from_uniforms`' re-draft)."""
    batch, k = draft_tokens.shape
    p = p_target.to(prob_dtype(p_target.dtype))
    q = None if q_draft is None else q_draft.to(p.dtype)
    lengths, valid = num_draft_mask(num_draft, batch, k, p.device)
    tokens = safe_tokens(draft_tokens, valid, p.shape[-1])  # [B, K]
    coins = None if uniforms is None else uniforms[:, :k]
    accept_prob, n, dist = decide_chain(rule, p, q, tokens, lengths, valid, coins)
    next_token = dist.argmax(-1) if uniforms is None else inverse_cdf(dist, uniforms[:, k:])
    result = assemble_chain(draft_tokens, n, next_token, accept_prob)
    return result, ChainState(p, q, tokens, lengths, coins, accept_prob, n)


def run_chain(
    rule: AcceptanceRule,
    draft_tokens: Tensor,
    p_target: Tensor,
    q_draft: Tensor | None,
    *,
    generator: Generators,
    num_draft: Tensor | None,
    greedy: bool,
    validate: bool,
    check_probs: bool = True,
) -> tuple[VerifyResult, ChainState]:
    """The chain engine behind `verify_chain` (which see), also returning its `ChainState`.

    RNG: the acceptance uniforms ``[B, K]`` (row b draws ``num_draft[b]`` of them), then one uniform per row for the
    correction / bonus sample; nothing when ``greedy``.
    """
    if not isinstance(rule, AcceptanceRule):
        raise TypeError(f"rule must be an AcceptanceRule (see make_rule), got {type(rule).__name__}")
    p, q, tokens, lengths, valid, checks = chain_setup(
        draft_tokens, p_target, q_draft, num_draft, validate, check_probs
    )
    check_generator(generator, tokens.shape[0], p.device)
    rule.check(p.shape[-1], checks if validate else None)
    checks.run()
    batch, k = tokens.shape
    coins = None if greedy else rand((batch, k), generator, device=p.device, dtype=p.dtype, counts=lengths)  # [B, K]
    accept_prob, n, dist = decide_chain(rule, p, q, tokens, lengths, valid, coins)
    next_token = dist.argmax(-1) if greedy else sample(dist, generator)
    result = assemble_chain(draft_tokens, n, next_token, accept_prob)
    return result, ChainState(p, q, tokens, lengths, coins, accept_prob, n)


def verify_chain(
    rule: AcceptanceRule,
    draft_tokens: Tensor,
    p_target: Tensor,
    q_draft: Tensor | None = None,
    *,
    generator: Generators,
    num_draft: Tensor | None = None,
    greedy: bool = False,
    validate: bool = True,
) -> VerifyResult:
    """Verify a chain of drafts with any acceptance rule (the module docstring's loop).

    Accept draft ``x_i`` with probability ``rule.accept(p_target[:, i], q_draft[:, i], x_i)``; at the first
    rejection emit ``y ~ rule.residual(...)`` there and stop; if every valid draft is accepted emit a bonus
    ``y ~ p_target[:, L]`` (``L = num_draft[b]``). ``greedy=True``: accept while ``rule.greedy_accept`` holds and
    emit the argmax of ``p_target`` at the stop (no randomness).

    Args:
        rule: an `AcceptanceRule` (`Exact`, `Lantern`, `Grouped`, or `make_rule(name, **knobs)`).
        draft_tokens: ``[B, K]`` drafts (entries at positions ``>= num_draft[b]`` are ignored, may be -1).
        p_target: ``[B, K+1, V]``; ``p_target[:, i]`` is the target distribution at draft position i,
            ``p_target[:, K]`` (or ``[b, num_draft[b]]``) the bonus distribution.
        q_draft: ``[B, K, V]`` distributions the drafts were drawn from, or None (point masses).
        generator: source of every random draw: a ``torch.Generator``, or a list with one per row
            (`mmspec.random`; a row's result and its generator's consumption then depend on that row only).
        num_draft: ``[B]`` valid drafts per row (ragged), default K.
        greedy: greedy decoding.
        validate: value checks (one host sync).

    Returns:
        `VerifyResult` with ``tokens [B, K+1]``.
    """
    result, _ = run_chain(
        rule,
        draft_tokens,
        p_target,
        q_draft,
        generator=generator,
        num_draft=num_draft,
        greedy=greedy,
        validate=validate,
    )
    return result


def verify_exact(
    draft_tokens: Tensor,
    p_target: Tensor,
    q_draft: Tensor | None = None,
    *,
    generator: Generators,
    num_draft: Tensor | None = None,
    validate: bool = True,
) -> VerifyResult:
    """Standard speculative sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, 2302.01318):
    `verify_chain` with the `Exact` rule.

    Accept draft ``x_i`` with probability ``min(1, p_i(x_i)/q_i(x_i))``; at the first rejection emit
    ``y ~ norm(max(0, p_i - q_i))`` and stop; if every valid draft is accepted emit a bonus ``y ~ p_{L}``
    (``L = num_draft[b]``). Every emitted token is distributed as ``p_target`` given the emitted prefix.
    ``q_draft=None``: point-mass drafts; accept with probability ``p(x)`` and on rejection sample ``p`` with ``x``
    zeroed. ``p == q`` gives acceptance 1 (no NaN); an all-zero residual falls back to ``p``.

    Args:
        draft_tokens, p_target, q_draft, generator, num_draft, validate: as `verify_chain`.

    Returns:
        `VerifyResult` with ``tokens [B, K+1]``.
    """
    return verify_chain(
        Exact(), draft_tokens, p_target, q_draft, generator=generator, num_draft=num_draft, validate=validate
    )


def verify_greedy(draft_tokens: Tensor, p_target: Tensor, num_draft: Tensor | None = None) -> VerifyResult:
    """Greedy verification: accept ``x_i`` iff ``x_i == argmax p_i``; emit ``argmax p`` at the first mismatch
    (or the bonus position). Exactly reproduces target-only greedy decoding.

    Args:
        draft_tokens: ``[B, K]``.
        p_target: ``[B, K+1, V]`` probabilities or logits (only the argmax is used; NaN raises ValueError).
        num_draft: ``[B]`` valid drafts per row.

    Returns:
        `VerifyResult` (``accept_prob`` is 0/1).
    """
    result, _ = run_chain(
        Exact(),
        draft_tokens,
        p_target,
        None,
        generator=None,
        num_draft=num_draft,
        greedy=True,
        validate=True,
        check_probs=False,
    )
    return result


def _given(**knobs) -> dict:
    """The knobs a caller actually set (None = the rule's default)."""
    return {name: value for name, value in knobs.items() if value is not None}


def verify_relaxed(
    draft_tokens: Tensor,
    p_target: Tensor,
    q_draft: Tensor | None = None,
    *,
    neighbours: Tensor,
    k: int | None = None,
    delta: float | None = None,
    lam: float | None = None,
    resample: str | None = None,
    generator: Generators,
    num_draft: Tensor | None = None,
    greedy: bool = False,
    validate: bool = True,
) -> VerifyResult:
    """LANTERN relaxed acceptance (Jang et al., arXiv 2410.03355; LANTERN++ arXiv 2502.06352), chain form:
    `verify_chain` with the `Lantern` rule (which documents the rule, its bounds and the differences from the
    release).

    Accept draft x with ``min(1, p~(x)/q(x))`` where ``p~(x) = p(x) + c_{m*}`` credits x with the target mass of
    its first ``m*`` latent neighbours (`relaxed_numerator`). ``greedy=True``: accept iff ``p~(x) >= max p``,
    correction = argmax p. Trees (LANTERN's main mode: EAGLE-2 dynamic tree, deterministic children):
    ``verify_tree(..., rule=Lantern(neighbours, delta=...))``.

    Args:
        draft_tokens: ``[B, K]``; p_target: ``[B, K+1, V]``; q_draft: ``[B, K, V]`` or None.
        neighbours: ``[V, k_max]`` from `codebook_neighbours` (precomputed once).
        k, delta, lam, resample: `Lantern`'s knobs, None = the rule's default; ``lam`` (LANTERN++) replaces
            ``delta`` when set.
        generator, num_draft, greedy, validate: as `verify_chain`.
    """
    rule = Lantern(neighbours=neighbours, **_given(k=k, delta=delta, lam=lam, resample=resample))
    return verify_chain(
        rule,
        draft_tokens,
        p_target,
        q_draft,
        generator=generator,
        num_draft=num_draft,
        greedy=greedy,
        validate=validate,
    )


def verify_grouped(
    draft_tokens: Tensor,
    p_target: Tensor,
    q_draft: Tensor | None = None,
    *,
    group_size: int | None = None,
    prob_threshold: float | None = None,
    dist_threshold: float | None = None,
    embeddings: Tensor | None = None,
    delta: float | None = None,
    resample: str | None = None,
    generator: Generators,
    num_draft: Tensor | None = None,
    validate: bool = True,
) -> VerifyResult:
    """Grouped speculative decoding, dynamic groups (GSD, So et al., arXiv 2508.07747), chain form:
    `verify_chain` with the `Grouped` rule (which documents the rule, its defaults and the ``delta`` cap).

    Accept x with ``min(1, P/Q)``, ``P, Q`` = target / draft mass of x's dynamic group (`grouped_masses`).
    Reject -> ``norm([p - q]_+)`` (``resample="released"``, as the paper and code) or Cool-SD's
    ``G* = norm([p - q a]_+)`` (``"optimal"``).

    Args:
        draft_tokens: ``[B, K]``; p_target: ``[B, K+1, V]``; q_draft: ``[B, K, V]`` or None (point masses).
        group_size, prob_threshold, dist_threshold, embeddings, delta, resample: `Grouped`'s knobs, None = the
            rule's default.
        generator, num_draft, validate: as `verify_chain`.
    """
    knobs = _given(
        group_size=group_size,
        prob_threshold=prob_threshold,
        dist_threshold=dist_threshold,
        delta=delta,
        resample=resample,
    )
    return verify_chain(
        Grouped(embeddings=embeddings, **knobs),
        draft_tokens,
        p_target,
        q_draft,
        generator=generator,
        num_draft=num_draft,
        validate=validate,
    )
