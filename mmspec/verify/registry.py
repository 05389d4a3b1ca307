"""Acceptance rules by name: ``acceptance="exact" | "relaxed" | "grouped"`` plus knobs -> a rule object."""

from dataclasses import fields

from torch import Tensor

from mmspec.verify.gsd import Grouped
from mmspec.verify.lantern import Lantern
from mmspec.verify.rules import AcceptanceRule, Exact


__all__ = ["RULE_CLASSES", "acceptance_probs", "make_rule", "rejection_step", "resolve_rule"]

# keyed by each class's `name` (the `acceptance=` string, spelled once on the class)
RULE_CLASSES: dict[str, type[AcceptanceRule]] = {cls.name: cls for cls in (Exact, Lantern, Grouped)}


def make_rule(name: str, **knobs) -> AcceptanceRule:
    """Build the acceptance rule ``name`` (``RULE_CLASSES``) with ``knobs`` (its dataclass fields; the others keep
    the class's defaults).

    Raises:
        ValueError: unknown ``name`` (the message lists the valid ones), or a bad knob value.
        TypeError: a knob the rule does not have (named in the message).
    """
    if name not in RULE_CLASSES:
        raise ValueError(f"acceptance must be one of {list(RULE_CLASSES)}, got {name!r}")
    cls = RULE_CLASSES[name]
    valid = {f.name for f in fields(cls)}
    unknown = set(knobs) - valid
    if unknown:
        raise TypeError(f"unexpected keyword(s) {sorted(unknown)} for acceptance={name!r}; valid: {sorted(valid)}")
    return cls(**knobs)


def resolve_rule(rule: AcceptanceRule | None, acceptance: str, resample: str, knobs: dict) -> AcceptanceRule:
    """The rule of a call that takes either ``rule=`` or the string form ``acceptance=`` / ``resample=`` / knobs."""
    if rule is None:
        return make_rule(acceptance, resample=resample, **knobs)
    if not isinstance(rule, AcceptanceRule):
        raise TypeError(f"rule must be an AcceptanceRule (see make_rule), got {type(rule).__name__}")
    if knobs or acceptance != "exact" or resample != "optimal":
        raise TypeError("pass either rule= or acceptance= / resample= / knobs, not both")
    return rule


def acceptance_probs(
    p_target: Tensor, q_draft: Tensor | None, tokens: Tensor, *, acceptance: str = "exact", **knobs
) -> Tensor:
    """Per-position acceptance probability of a draft token: ``make_rule(acceptance, **knobs).accept(...)``.

    * ``"exact"``: ``min(1, p(x)/q(x))`` (`Exact`; ``q(x) = 1`` for point-mass drafts).
    * ``"relaxed"``: ``min(1, p~(x)/q(x))`` with LANTERN's numerator (`Lantern`; knobs ``neighbours``, ``k``,
      ``delta`` | ``lam``).
    * ``"grouped"``: ``min(1, P/Q)`` with GSD group masses (`Grouped`; knobs ``group_size``, ``prob_threshold``,
      ``dist_threshold``, ``embeddings``, ``delta``).

    Args:
        p_target: ``[..., V]``; q_draft: ``[..., V]`` or None; tokens: ``[...]``.

    Returns:
        ``[...]`` probabilities in [0, 1].
    """
    rule = make_rule(acceptance, **knobs)
    rule.check(p_target.shape[-1])
    return rule.accept(p_target, q_draft, tokens)


def rejection_step(
    residual: Tensor,
    q_draft: Tensor | None,
    tokens: Tensor,
    *,
    acceptance: str = "exact",
    resample: str = "optimal",
    **knobs,
) -> tuple[Tensor, Tensor]:
    """One step of (recursive) rejection sampling at a node (SpecInfer; EAGLE-2; RSD):
    ``make_rule(acceptance, resample=resample, **knobs).step(...)``.

    Given the current target residual ``r`` at a node (``p_target`` before any sibling was rejected) and a draft
    ``x ~ q_draft`` (``None``: point mass), returns the probability of accepting ``x`` and the distribution to
    continue with after rejecting it: ``resample="optimal"`` is Cool-SD's TV-optimal ``G* = norm([r - q a]_+)``
    (the Leviathan residual ``norm([r - q]_+)`` for every rule whose acceptance is pointwise >= the exact one),
    ``"released"`` as the paper's code (see `Lantern`, `Grouped`).

    Args:
        residual: ``[..., V]`` current target residual; q_draft: ``[..., V]`` or None; tokens: ``[...]``.

    Returns:
        ``(accept_prob [...], next_residual [..., V])``.
    """
    rule = make_rule(acceptance, resample=resample, **knobs)
    rule.check(residual.shape[-1])
    return rule.step(residual, q_draft, tokens)
