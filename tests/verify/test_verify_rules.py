"""Acceptance rules as objects (`Exact`, `Lantern`, `Grouped`) and their string-and-knobs forms.

Proofs: each rule class is the one place its defaults live (the wrappers' and building blocks' unset knobs give the
class defaults); the rule-object and string forms of every entry point are bit-identical; `acceptance_probs` /
`rejection_step` are the rule methods; `step` = (`accept`, `residual`) on the same residual; LANTERN++'s ``lam``
replaces ``delta``; greedy tests; a user-defined rule plugs into the chain and tree engines and (being lossless by
construction) emits tokens distributed as p_target.
"""

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from mmspec.verify import (
    RULE_CLASSES,
    AcceptanceRule,
    Exact,
    Grouped,
    Lantern,
    acceptance_probs,
    codebook_neighbours,
    grouped_masses,
    make_rule,
    rejection_step,
    residual_probs,
    verify_chain,
    verify_exact,
    verify_grouped,
    verify_jacobi,
    verify_relaxed,
    verify_tree,
)
from mmspec.verify.rules import ratio_accept


V = 6


def _inputs(seed, batch=300, k=3):
    gen = torch.Generator().manual_seed(seed)
    p = (torch.randn(batch, k + 1, V, generator=gen) * 1.5).softmax(-1)
    q = (torch.randn(batch, k, V, generator=gen) * 1.5).softmax(-1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=gen).reshape(batch, k)
    num_draft = torch.randint(0, k + 1, (batch,), generator=gen)
    nb = codebook_neighbours(torch.randn(V, 3, generator=gen), 4)
    emb = torch.nn.functional.normalize(torch.randn(V, 3, generator=gen), dim=-1)
    return drafts, p, q, num_draft, nb, emb


def _equal(a, b):
    for name in ("num_accepted", "tokens", "accept_mask", "path", "next_drafts", "next_q"):
        x, y = getattr(a, name, None), getattr(b, name, None)
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), name
    torch.testing.assert_close(a.accept_prob, b.accept_prob, rtol=0, atol=0, equal_nan=True)


def test_rule_classes_and_attributes():
    assert RULE_CLASSES == {"exact": Exact, "relaxed": Lantern, "grouped": Grouped}
    assert [cls.name for cls in RULE_CLASSES.values()] == list(RULE_CLASSES)
    assert Exact.lossless and not Lantern.lossless and not Grouped.lossless
    nb = torch.zeros(V, 2, dtype=torch.long)
    rule = Lantern(nb, 1, 0.1)  # positional order: neighbours, k, delta, lam; resample is keyword-only
    assert (rule.neighbours is nb, rule.k, rule.delta, rule.lam, rule.resample) == (True, 1, 0.1, None, "optimal")
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.delta = 0.3
    assert (
        isinstance(make_rule("grouped", group_size=3), Grouped) and make_rule("grouped", group_size=3).group_size == 3
    )


def test_defaults_live_in_the_rule_classes(make_generator):
    """Unset knobs of the wrappers and building blocks are the dataclass defaults (no second copy of them)."""
    drafts, p, q, num_draft, nb, emb = _inputs(0)
    g = Grouped(embeddings=emb)
    assert (g.group_size, g.prob_threshold, g.dist_threshold, g.delta, g.resample) == (25, 0.15, 1.0, None, "optimal")
    lantern = Lantern(nb)
    assert (lantern.k, lantern.delta, lantern.lam, lantern.resample) == (None, 0.2, None, "optimal")
    for rule, call in [
        (g, lambda gen: verify_grouped(drafts, p, q, embeddings=emb, generator=gen, num_draft=num_draft)),
        (lantern, lambda gen: verify_relaxed(drafts, p, q, neighbours=nb, generator=gen, num_draft=num_draft)),
    ]:
        _equal(
            call(make_generator(1)), verify_chain(rule, drafts, p, q, generator=make_generator(1), num_draft=num_draft)
        )
    tokens = drafts[:, 0]
    for a, b in zip(grouped_masses(p[:, 0], q[:, 0], tokens), Grouped().masses(p[:, 0], q[:, 0], tokens)):
        assert torch.equal(a, b)
    assert torch.equal(
        acceptance_probs(p[:, 0], q[:, 0], tokens, acceptance="grouped"), Grouped().accept(p[:, 0], q[:, 0], tokens)
    )


def test_lam_replaces_delta():
    _, p, q, _, nb, _ = _inputs(1)
    tokens = torch.randint(0, V, (p.shape[0],), generator=torch.Generator().manual_seed(0))
    a = Lantern(nb, lam=3.0).accept(p[:, 0], None, tokens)
    b = Lantern(nb, delta=None, lam=3.0).accept(p[:, 0], None, tokens)
    c = Lantern(nb, delta=0.0).accept(p[:, 0], None, tokens)
    assert torch.equal(a, b) and (a >= c).all() and (a > c).any()


@pytest.mark.parametrize("point_mass", [False, True])
def test_functional_forms_are_the_rule_methods(point_mass):
    _, p, q, _, nb, emb = _inputs(2)
    r, qq = p[:, 0], (None if point_mass else q[:, 0])
    tokens = torch.multinomial(q[:, 0], 1, generator=torch.Generator().manual_seed(0)).squeeze(-1)
    cases = [
        ("exact", {}),
        ("relaxed", {"neighbours": nb, "delta": 0.1, "resample": "released"}),
        ("relaxed", {"neighbours": nb, "lam": 2.0, "k": 2}),
        ("grouped", {"group_size": 3, "embeddings": emb, "resample": "optimal"}),
        ("grouped", {"delta": 0.05, "resample": "released"}),
    ]
    for name, knobs in cases:
        rule = make_rule(name, **knobs)
        accept, resid = rule.step(r, qq, tokens)
        assert torch.equal(accept, rule.accept(r, qq, tokens)), name
        assert torch.equal(resid, rule.residual(r, qq, tokens)), name
        assert torch.equal(acceptance_probs(r, qq, tokens, acceptance=name, **knobs), accept)
        step = rejection_step(r, qq, tokens, acceptance=name, **knobs)
        assert torch.equal(step[0], accept) and torch.equal(step[1], resid)
        torch.testing.assert_close(resid.sum(-1), torch.ones(len(r)))


@pytest.mark.parametrize("name", ["relaxed", "grouped"])
def test_rule_objects_equal_string_forms(name, make_generator):
    drafts, p, q, num_draft, nb, emb = _inputs(3)
    knobs = {"neighbours": nb, "delta": 0.15} if name == "relaxed" else {"group_size": 3, "embeddings": emb}
    rule = make_rule(name, **knobs)
    for coupling in (False, True):
        _equal(
            verify_jacobi(drafts, p, q, generator=make_generator(4), coupling=coupling, acceptance=name, **knobs),
            verify_jacobi(drafts, p, q, generator=make_generator(4), coupling=coupling, rule=rule),
        )
    parents = torch.tensor([-1, -1, 0])
    for mode, qq in [("deterministic", None), ("iid", q)]:
        _equal(
            verify_tree(drafts, parents, p, qq, mode=mode, generator=make_generator(5), acceptance=name, **knobs),
            verify_tree(drafts, parents, p, qq, mode=mode, generator=make_generator(5), rule=rule),
        )


def test_greedy_tests():
    p = torch.tensor([[0.3, 0.1, 0.25, 0.35]])
    nb = torch.tensor([[2, 1, 3], [0, 2, 3], [0, 1, 3], [2, 1, 0]])
    assert (
        Exact().greedy_accept(p, torch.tensor([3])).item() and not Exact().greedy_accept(p, torch.tensor([0])).item()
    )
    assert Lantern(nb, delta=0.3).greedy_accept(p, torch.tensor([0])).item()  # p~(0) = 0.55 >= 0.35
    assert not Lantern(nb, delta=0.01).greedy_accept(p, torch.tensor([0])).item()
    with pytest.raises(ValueError, match="greedy=True is defined for acceptance 'exact' and 'relaxed' only"):
        Grouped().greedy_accept(p, torch.tensor([0]))


@dataclass(frozen=True, eq=False)
class HalfExact(AcceptanceRule):
    """A user-defined rule: half the exact acceptance, resampled from G* = norm([p - q a]_+) -- lossless, since
    q a <= p keeps the total residual mass at 1 - sum q a."""

    name: ClassVar[str] = "half"
    lossless: ClassVar[bool] = True

    def accept(self, p_target, q_draft, tokens):
        return 0.5 * Exact().accept(p_target, q_draft, tokens)

    def residual(self, residual, q_draft, tokens):
        q = torch.nn.functional.one_hot(tokens, residual.shape[-1]).to(residual) if q_draft is None else q_draft
        a = 0.5 * ratio_accept(residual, q)  # the acceptance of every token
        return residual_probs(residual, q * a)


@pytest.mark.parametrize("point_mass", [False, True])
def test_user_defined_rule_plugs_into_the_engines(point_mass, make_generator, chi2_pvalue):
    rows = 100_000
    p = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.06, 0.04])
    q = torch.tensor([0.1, 0.3, 0.1, 0.2, 0.2, 0.1])
    gen = make_generator(6 + point_mass)
    x = (
        torch.full((rows, 1), 1)
        if point_mass
        else torch.multinomial(q, rows, replacement=True, generator=gen)[:, None]
    )
    qq = None if point_mass else q.expand(rows, 1, V)
    res = verify_chain(HalfExact(), x, p.expand(rows, 2, V), qq, generator=gen)
    exact = verify_exact(x, p.expand(rows, 2, V), qq, generator=make_generator(0))
    torch.testing.assert_close(res.accept_prob, 0.5 * exact.accept_prob)
    assert chi2_pvalue(res.tokens[:, 0], p) > 1e-4
    tree = verify_tree(
        x,
        torch.tensor([-1]),
        p.expand(rows, 2, V),
        qq,
        mode="deterministic" if point_mass else "iid",
        generator=gen,
        rule=HalfExact(),
    )
    assert chi2_pvalue(tree.tokens[:, 0], p) > 1e-4
