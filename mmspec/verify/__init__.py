"""Verifier core: pure, batched acceptance rules for speculative decoding.

Notation (spelled out once): ``p_target`` is the target model's distribution, ``q_draft`` the distribution the
draft token was actually drawn from, both *after* the same processing (`mmspec.sampling.SamplingParams.probs`).
``q_draft=None`` means point-mass drafts (argmax, top-k tree children, lookup, fresh Jacobi tokens): ``q(x) = 1``.
Docstrings write ``p`` / ``q`` for them inside formulas.

Two layers:

* acceptance rules (`AcceptanceRule` objects: frozen dataclasses whose fields are the knobs, each class the one
  place where its defaults live) answer the per-position questions: accept with which probability, continue with
  which residual after a rejection, and the greedy test;
* draft structures (chain, Jacobi window, tree; continuous tokens) run a rule over their drafts.

===================  ======================================================================  ==========  =============
name                 paper (arXiv)                                                           module      lossless
===================  ======================================================================  ==========  =============
`Exact`              Leviathan et al. 2023 (2211.17192); Chen et al. 2023 (2302.01318)       rules       yes
`Lantern`            LANTERN (2410.03355), LANTERN++ (2502.06352); G*: Cool-SD (2601.09212)  lantern     no (TV bound)
`Grouped`            GSD (2508.07747)                                                        gsd         no
`verify_chain`       the Leviathan / Chen chain loop with any rule                           chain       as the rule
`verify_greedy`      argmax matching                                                         chain       yes (T=0)
`verify_jacobi`      SJD (2410.01699); coupled re-draft: SCD / MC-SJD (2510.24211)           jacobi      as the rule
`verify_tree`        SpecInfer (2305.09781), EAGLE-2 (2406.16858), RSD (2402.14160)          tree        as the rule
`verify_continuous`  CSpD (2411.11925)                                                       continuous  yes (T_in=1)
===================  ======================================================================  ==========  =============

Every entry point is a pure function of tensors plus ``generator``; it keeps a leading batch dim ``B`` with ragged
acceptance per row, is vectorised over batch and vocabulary (Python loops only run over tree depth / siblings or
residual-sampling tries) and computes probabilities in float32 (float64 inputs stay float64). ``generator`` is one
``torch.Generator`` or a list with one per row (`mmspec.random`): with a list, a row's result and the state its
generator is left in depend only on that row's inputs, whatever the padding from other rows.

Names: the rules by ``acceptance=`` string are in ``RULE_CLASSES`` / `make_rule`; the entry points by name in
``RULES`` / `get_rule`. Building blocks: `acceptance_probs` (per-position acceptance of any rule) and
`rejection_step` (acceptance + residual after a rejection), string-and-knobs forms of the rule methods;
`residual_probs`, `relaxed_numerator`, `grouped_masses`, `codebook_neighbours`. ``RESAMPLES``: the ``resample=``
choices of every rule.

RNG consumption order with one generator (so that rules sharing a generator state see the same coins): chains draw
the acceptance uniforms ``[B, K]`` first, then one uniform per row for the correction / bonus token (inverse-CDF
sampling, `mmspec.sampling.sample`). This is what makes "relaxed acceptance is never below exact acceptance on the
same draws" and "a singleton neighbourhood is bit-identical to `verify_exact`" testable.
"""

from collections.abc import Callable

from mmspec.verify.chain import verify_chain, verify_exact, verify_greedy, verify_grouped, verify_relaxed
from mmspec.verify.continuous import verify_continuous
from mmspec.verify.gsd import Grouped, grouped_masses
from mmspec.verify.jacobi import verify_jacobi
from mmspec.verify.lantern import Lantern, codebook_neighbours, relaxed_numerator
from mmspec.verify.registry import RULE_CLASSES, acceptance_probs, make_rule, rejection_step
from mmspec.verify.results import ContinuousResult, JacobiResult, VerifyResult
from mmspec.verify.rules import RESAMPLES, AcceptanceRule, Exact, residual_probs
from mmspec.verify.tree import verify_tree


__all__ = [
    "RESAMPLES",
    "RULES",
    "RULE_CLASSES",
    "AcceptanceRule",
    "ContinuousResult",
    "Exact",
    "Grouped",
    "JacobiResult",
    "Lantern",
    "VerifyResult",
    "acceptance_probs",
    "codebook_neighbours",
    "get_rule",
    "grouped_masses",
    "make_rule",
    "rejection_step",
    "relaxed_numerator",
    "residual_probs",
    "verify_chain",
    "verify_continuous",
    "verify_exact",
    "verify_greedy",
    "verify_grouped",
    "verify_jacobi",
    "verify_relaxed",
    "verify_tree",
]


# the entry points by name: `verify_<name>` (the acceptance names of the rules are the rule classes' `name`s)
RULES: dict[str, Callable[..., VerifyResult]] = {
    fn.__name__.removeprefix("verify_"): fn
    for fn in (
        verify_exact,
        verify_greedy,
        verify_tree,
        verify_relaxed,
        verify_grouped,
        verify_jacobi,
        verify_continuous,
    )
}


def get_rule(name: str) -> Callable[..., VerifyResult]:
    """Look up a verification entry point by name (``RULES``); unknown names raise ValueError listing the valid
    ones. (Acceptance rules as objects: `make_rule`.)"""
    if name not in RULES:
        raise ValueError(f"unknown rule {name!r}; valid rules: {sorted(RULES)}")
    return RULES[name]
