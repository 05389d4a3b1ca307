"""Speculative Jacobi decoding: chain verification of the previous iteration's tokens, then the re-draft.

Papers: SJD (Teng et al., arXiv 2410.01699; release tyshiwo1/Accelerating-T2I-AR-with-SJD); coupled re-drafting
from SCD / MC-SJD (So et al., arXiv 2510.24211). No draft model: the draft at position i is the token the target
itself sampled there in the previous Jacobi iteration, conditioned on a then-unverified prefix; its ``q_draft`` is
that iteration's processed distribution (one-hot for freshly initialised tokens). Verification is the chain engine
(`mmspec.verify.chain.run_chain`) with any acceptance rule (GSD = SJD + `Grouped`).
"""

import torch
from torch import Tensor

from mmspec.random import Generators, rand
from mmspec.sampling import inverse_cdf, sample
from mmspec.verify.chain import run_chain, run_chain_from_uniforms
from mmspec.verify.registry import resolve_rule
from mmspec.verify.results import JacobiResult
from mmspec.verify.rules import AcceptanceRule, Exact, residual_probs


__all__ = ["carry_window", "coupled_redraft", "jacobi_from_uniforms", "jacobi_uniforms", "verify_jacobi"]


def verify_jacobi(
    draft_tokens: Tensor,
    p_target: Tensor,
    q_draft: Tensor | None = None,
    *,
    generator: Generators,
    coupling: bool = False,
    num_draft: Tensor | None = None,
    rule: AcceptanceRule | None = None,
    acceptance: str = "exact",
    resample: str = "optimal",
    validate: bool = True,
    **knobs,
) -> JacobiResult:
    """Speculative Jacobi decoding step (SJD) with optional coupling (SCD / MC-SJD).

    The window's drafts were produced by the previous Jacobi iteration; ``q_draft`` is that iteration's processed
    distribution at each position (one-hot for freshly initialised tokens, or None if all are fresh). Verification
    is `verify_chain` with ``rule`` (default `Exact`). Then every position after the committed correction is
    re-drafted from THIS iteration's distributions ``p_target[:, j]`` (conditioned on the stale drafts) with
    ``q := p_target[:, j]``:

    * ``coupling=False`` (SJD): independent samples ``y_j ~ p_j``;
    * ``coupling=True`` (SCD): maximal coupling with the old draft: keep ``d_j`` with probability
      ``min(1, p_j(d_j)/q_j(d_j))`` (re-using the unused verification coin of position j), else sample
      ``norm([p_j - q_j]_+)``. Marginally ``y_j ~ p_j`` (so verification stays lossless) while drafts repeat far
      more often, which raises acceptance. Position ``L = num_draft[b]`` has no old draft: always a fresh sample.

    RNG (after the chain's coins ``[B, K]`` and correction sample): the fresh samples ``[B, K+1]`` (row b draws
    ``L + 1``), then with coupling the residual samples ``[B, K]`` (row b draws ``L``).

    Args:
        draft_tokens: ``[B, K]`` window drafts; p_target: ``[B, K+1, V]`` this iteration's distributions;
            q_draft: ``[B, K, V]`` or None.
        coupling: maximal-coupling re-draft.
        rule: the acceptance rule (an `AcceptanceRule`); or the string form ``acceptance`` / ``resample`` /
            ``knobs`` (`make_rule`), kept for compatibility.
        generator, num_draft, validate: as `verify_chain`.

    Returns:
        `JacobiResult`: the verification plus ``next_drafts [B, K]`` (left-aligned, ``num_carried`` valid, -1
        after), their distributions ``next_q [B, K, V]``. Row b carries ``L - n`` drafts (positions ``n+1..L``)
        when it stopped at a rejection, else 0.
    """
    rule = resolve_rule(rule, acceptance, resample, knobs)
    result, chain = run_chain(
        rule,
        draft_tokens,
        p_target,
        q_draft,
        generator=generator,
        num_draft=num_draft,
        greedy=False,
        validate=validate,
    )
    p, q, tokens, lengths, n = chain.p, chain.q, chain.tokens, chain.lengths, chain.num_accepted

    # Re-draft every position j = 0..L from this iteration's p_j (only j in n+1..L are kept); SCD re-uses the
    # verification coin of position j, unused after the first rejection
    exact_accept = chain.accept_prob if type(rule) is Exact else None
    redraft = coupled_redraft(p, q, tokens, lengths, generator, coupling=coupling, coins=chain.coins,
                              accept_prob=exact_accept)  # fmt: skip
    return JacobiResult.carrying(result, *carry_window(redraft, p, n, lengths))


def coupled_redraft(
    p: Tensor,
    q: Tensor,
    drafts: Tensor,
    lengths: Tensor,
    generator: Generators,
    *,
    coupling: bool = True,
    coins: Tensor | None = None,
    accept_prob: Tensor | None = None,
    uniforms: Tensor | None = None,
) -> Tensor:
    """The Jacobi re-draft of every window position from this round's distributions: SJD's independent samples, or
    SCD's coupled re-draft (Speculative Coupled Decoding / MC-SJD, So et al., arXiv 2510.24211), which keeps each
    old draft as often as maximal coupling allows.

    Position ``j`` (``0 .. L``, ``L = lengths[b]``) gets ``y_j ~ p_j``. With ``coupling``, a position with an old
    draft ``d_j`` (``j < L``) keeps it with probability ``min(1, p_j(d_j) / q_j(d_j))`` (the coin ``coins[:, j]`` <
    ``accept_prob[:, j]``), else takes ``y ~ norm([p_j - q_j]_+)``: marginally still ``y_j ~ p_j`` (verification
    stays lossless), while drafts repeat far more often. Position ``L`` has no old draft: always the fresh sample.
    Used by `verify_jacobi` (chains; the verification coins) and `mmspec.verify.jacobi_tree.verify_jacobi_tree`
    (SJD-PAC's main branch; fresh coins).

    RNG: the fresh samples ``[B, K+1]`` (row b draws ``L + 1``); then with coupling, when ``coins`` is None, fresh
    coins ``[B, K]`` (row b draws ``L``); then the residual samples ``[B, K]`` (row b draws ``L``).

    Args:
        p: ``[B, K+1, V]`` this round's distribution at each position; q: ``[B, K, V]`` the old drafts' laws;
            drafts: ``[B, K]`` the old drafts (valid ids); lengths: ``[B]`` old drafts per row.
        generator: one ``torch.Generator`` or one per row; coupling: SCD (True) or SJD (False).
        coins: ``[B, K]`` uniforms to re-use (default: drawn here); accept_prob: ``[B, K]`` the exact acceptance
            probability ``min(1, p/q)`` at the drafts, when already computed (default: computed here).
        uniforms: ``[B, 2K+1]`` float64 uniforms drawn beforehand (then `generator` is not used, and `coins` must
            be given with coupling): ``[:, :K+1]`` the fresh samples', ``[:, K+1:]`` the residual samples', each
            token the inverse CDF of its distribution at its uniform (`mmspec.sampling.inverse_cdf`): what a
            captured graph runs (`jacobi_from_uniforms`).

    Returns: ``[B, K+1]`` one re-draft per window position."""
    batch, k = drafts.shape
    if uniforms is None:
        redraft = sample(p, generator, counts=lengths + 1)  # [B, K+1] fresh
    else:
        redraft = inverse_cdf(p, uniforms[:, : k + 1, None])
    if not coupling or k == 0:
        return redraft
    if coins is None:
        coins = rand((batch, k), generator, device=p.device, dtype=p.dtype, counts=lengths)
    if accept_prob is None:
        accept_prob = Exact().accept(p[:, :k], q, drafts)
    keep = coins < accept_prob  # [B, K]
    moved = residual_probs(p[:, :k], q, drafts)
    if uniforms is None:
        moved = sample(moved, generator, counts=lengths)  # [B, K]
    else:
        moved = inverse_cdf(moved, uniforms[:, k + 1 :, None])
    coupled = torch.where(keep, drafts, moved)
    has_old = torch.arange(k, device=p.device) < lengths[:, None]  # an old draft to couple with
    return torch.cat([torch.where(has_old, coupled, redraft[:, :k]), redraft[:, k:]], dim=1)


def jacobi_uniforms(width: int) -> int:
    """Uniforms per row a Jacobi round of `width` drafts takes in `jacobi_from_uniforms`: ``3 * width + 2``."""
    return 3 * int(width) + 2


def jacobi_from_uniforms(
    rule: AcceptanceRule,
    draft_tokens: Tensor,
    p_target: Tensor,
    q_draft: Tensor,
    num_draft: Tensor,
    uniforms: Tensor,
    coupling: bool,
) -> JacobiResult:
    """`verify_jacobi` (unvalidated) as a pure tensor function of pre-drawn uniforms: what a captured graph runs
    (`mmspec.decoding.captured_verify`), SJD (Teng et al., arXiv 2410.01699) and, with `coupling`, SCD's coupled
    re-draft (So et al., arXiv 2510.24211), under any acceptance rule (GSD: `Grouped`).

    ``uniforms [B, 3K + 2]`` (float64, `jacobi_uniforms`): ``[:, :K]`` the acceptance coins (SCD re-uses them for
    the coupling, as `verify_jacobi` does), ``[:, K]`` the next token's draw from the residual or bonus distribution,
    ``[:, K+1 : 2K+2]`` the fresh re-draft of every window position, ``[:, 2K+2:]`` the coupled residual re-drafts;
    each token the inverse CDF of its distribution at its uniform. The law of `verify_jacobi`, another random stream
    (one draw per generator and round instead of per-row counts). Greedy decoding needs no other path: its
    ``p_target`` is one-hot, which any uniform maps to its argmax."""
    k = draft_tokens.shape[1]
    result, chain = run_chain_from_uniforms(rule, draft_tokens, p_target, q_draft, num_draft, uniforms[:, : k + 1])
    p, lengths = chain.p, chain.lengths
    exact_accept = chain.accept_prob if type(rule) is Exact else None
    redraft = coupled_redraft(p, chain.q, chain.tokens, lengths, None, coupling=coupling, coins=chain.coins,
                              accept_prob=exact_accept, uniforms=uniforms[:, k + 1 :])  # fmt: skip
    return JacobiResult.carrying(result, *carry_window(redraft, p, chain.num_accepted, lengths))


def carry_window(redraft: Tensor, p: Tensor, num_accepted: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The next Jacobi window from this round's re-drafts: a row that accepted ``n < L`` drafts (``lengths [B]`` =
    L) carries the re-drafts of positions ``n+1 .. L`` (``redraft [B, K+1]``, one per window position), left-aligned,
    with their laws ``p [B, K+1, V]`` as the next ``q_draft``; a row that accepted its whole window carries nothing.

    Returns: ``(next_drafts [B, K] (-1 after the carried ones), next_q [B, K, V] (0 after), num_carried [B])``."""
    batch, k, vocab = redraft.shape[0], redraft.shape[1] - 1, p.shape[-1]
    num_carried = torch.where(num_accepted < lengths, lengths - num_accepted, 0)  # [B]
    slot = torch.arange(k, device=p.device)
    src = (num_accepted[:, None] + 1 + slot).clamp(max=k)  # [B, K] source position in this window
    carried = slot < num_carried[:, None]
    next_drafts = torch.where(carried, redraft.gather(1, src), -1)
    next_q = torch.where(carried[..., None], p.gather(1, src[..., None].expand(batch, k, vocab)), 0.0)
    return next_drafts, next_q, num_carried
