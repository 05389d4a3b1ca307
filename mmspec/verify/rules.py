"""Acceptance rules as objects: the `AcceptanceRule` base class and the exact (lossless) rule.

A rule answers the per-position questions of speculative sampling, whatever the draft structure (chain, tree,
Jacobi window) around it:

* `AcceptanceRule.accept`: the probability of accepting a draft token ``x ~ q_draft`` against ``p_target``;
* `AcceptanceRule.residual`: the distribution to continue with after rejecting it (the correction token at the end
  of a chain, the next sibling's target in a tree);
* `AcceptanceRule.greedy_accept`: the deterministic test of greedy decoding;
* `AcceptanceRule.check`: knob validation against the vocabulary.

Rules are frozen dataclasses whose fields are their knobs; each class is the one place where its knobs' defaults
are defined. `Exact` is here; `mmspec.verify.lantern.Lantern` (LANTERN / LANTERN++) and `mmspec.verify.gsd.Grouped`
(GSD) live with their papers. `mmspec.verify.registry.make_rule` builds one from a name and knobs.
"""

from dataclasses import dataclass, field
from typing import ClassVar

from torch import Tensor

from mmspec.verify.checks import Checks, check_choice, gather_last, normalize


__all__ = ["RESAMPLES", "AcceptanceRule", "Exact", "residual_probs"]

RESAMPLES = ("optimal", "released")


def residual_probs(p_target: Tensor, q_draft: Tensor | None = None, tokens: Tensor | None = None) -> Tensor:
    """The residual ``norm(max(0, p_target - q_draft))`` of Leviathan et al. / Chen et al.

    Args:
        p_target: ``[..., V]``.
        q_draft: ``[..., V]``, or ``None`` for point-mass drafts at ``tokens`` (then the residual is
            ``p_target`` with the draft token zeroed, renormalised).
        tokens: ``[...]`` draft tokens, required when ``q_draft`` is None.

    Returns:
        ``[..., V]``; rows whose residual has no mass (``p_target <= q_draft`` everywhere, i.e. p == q: the
        residual is then never sampled) fall back to ``p_target`` instead of producing NaN.
    """
    if q_draft is None:
        if tokens is None:
            raise ValueError("tokens is required when q_draft is None (point-mass drafts)")
        weights = p_target.scatter(-1, tokens.unsqueeze(-1), 0.0)  # [p - delta_x]_+ (p <= 1)
    else:
        weights = (p_target - q_draft).clamp_min(0)
    return normalize(weights, p_target)


def ratio_accept(numerator: Tensor, q_x: Tensor | None) -> Tensor:
    """``min(1, numerator / q(x))`` (``q(x) = 1`` for point-mass drafts). ``q(x) = 0`` at a draft token is invalid
    input (caught by validation): ratio inf -> accept, 0/0 -> reject."""
    if q_x is None:
        return numerator.clamp_max(1)
    return (numerator / q_x).clamp_max(1).nan_to_num(0.0)


@dataclass(frozen=True, eq=False)
class AcceptanceRule:
    """Base class of the acceptance rules (a frozen dataclass: the fields are the knobs).

    Attributes:
        name: ``"exact"`` | ``"relaxed"`` | ``"grouped"`` (class attribute; the ``acceptance=`` string).
        lossless: every emitted token is distributed as ``p_target`` (class attribute).
        resample: residual after a rejection: ``"optimal"`` (Cool-SD's TV-optimal ``G* = norm([p - q a]_+)``,
            arXiv 2601.09212) or ``"released"`` (as the paper's code). For the exact rule both are the Leviathan
            residual ``norm([p - q]_+)``.

    Rules compare by identity (their knobs may be tensors). Shapes: ``p_target`` / ``residual`` / ``q_draft`` are ``[..., V]`` (``q_draft=None``: point-mass drafts,
    ``q(x) = 1``), ``tokens`` is ``[...]``.
    """

    name: ClassVar[str]
    lossless: ClassVar[bool]
    resample: str = field(default="optimal", kw_only=True)  # keyword-only: after the subclasses' knobs

    def __post_init__(self):
        check_choice("resample", self.resample, RESAMPLES)

    def accept(self, p_target: Tensor, q_draft: Tensor | None, tokens: Tensor) -> Tensor:
        """Probability ``[...]`` (in [0, 1]) of accepting draft ``tokens`` drawn from ``q_draft``."""
        raise NotImplementedError

    def residual(self, residual: Tensor, q_draft: Tensor | None, tokens: Tensor) -> Tensor:
        """The distribution ``[..., V]`` to continue with after rejecting ``tokens`` (drawn from ``q_draft``) at a
        node whose current target residual is ``residual``. Default: ``norm([r - q]_+)`` (`residual_probs`)."""
        return residual_probs(residual, q_draft, tokens)

    def step(self, residual: Tensor, q_draft: Tensor | None, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """One step of recursive rejection sampling: ``(accept(...), residual(...))`` on the same ``residual``."""
        return self.accept(residual, q_draft, tokens), self.residual(residual, q_draft, tokens)

    def greedy_accept(self, p_target: Tensor, tokens: Tensor) -> Tensor:
        """Greedy decoding: bool ``[...]``, whether ``tokens`` passes (``p_target`` may be logits where the rule
        only needs the argmax)."""
        raise ValueError("greedy=True is defined for acceptance 'exact' and 'relaxed' only")

    def check(self, vocab: int, checks: Checks | None = None) -> None:
        """Validate the knobs against a vocabulary of ``vocab`` tokens: shape / type errors raise at once; value
        checks on knob tensors (index ranges) are added to ``checks`` when given (synced with the call's other
        value checks) and skipped otherwise."""


@dataclass(frozen=True, eq=False)
class Exact(AcceptanceRule):
    """Standard speculative sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, 2302.01318).

    Accept ``x ~ q_draft`` with ``min(1, p_target(x) / q_draft(x))``; on rejection continue with
    ``norm([p_target - q_draft]_+)``. Every emitted token is distributed as ``p_target``. Point-mass drafts
    (``q_draft=None``): accept with ``p_target(x)``, on rejection zero x and renormalise. ``resample`` has no
    effect (both choices are this residual). Greedy: accept iff ``x == argmax p_target``.
    """

    name: ClassVar[str] = "exact"
    lossless: ClassVar[bool] = True

    def accept(self, p_target: Tensor, q_draft: Tensor | None, tokens: Tensor) -> Tensor:
        q_x = None if q_draft is None else gather_last(q_draft, tokens)
        return ratio_accept(gather_last(p_target, tokens), q_x)

    def greedy_accept(self, p_target: Tensor, tokens: Tensor) -> Tensor:
        return tokens == p_target.argmax(-1)
