"""Per-row generators: a row's result does not depend on the rest of its batch.

With ``generator=[g_0, ..., g_{B-1}]`` (`mmspec.random`), every rule must give row b exactly the result it gets when
verified alone (its own width: ``num_draft[b]`` drafts, or only its own tree nodes) with an identically seeded
generator, and leave ``g_b`` in the same state -- although the batch pads the row to the widest row's width and the
loops (tree depth / siblings, residual tries) run for the whole batch. Covered: exact, relaxed, grouped (both
resamplings), Jacobi with and without coupling, trees in every mode and continuous tokens.
"""

import pytest
import torch

import mmspec.verify.continuous as continuous
from mmspec.verify import (
    Grouped,
    Lantern,
    codebook_neighbours,
    verify_chain,
    verify_continuous,
    verify_exact,
    verify_grouped,
    verify_jacobi,
    verify_relaxed,
    verify_tree,
)


V, K = 7, 5
LENGTHS = [5, 0, 2, 3, 1, 5, 4]  # num_draft per row (rows 0 and 5 are full width)
SEEDS = [11 + 7 * b for b in range(len(LENGTHS))]


def _gens():
    return [torch.Generator().manual_seed(s) for s in SEEDS]


def _chain_inputs(seed=0, point_mass=False):
    gen = torch.Generator().manual_seed(seed)
    batch = len(LENGTHS)
    p = (torch.randn(batch, K + 1, V, generator=gen) * 1.5).softmax(-1)
    q = (torch.randn(batch, K, V, generator=gen) * 1.5).softmax(-1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=gen).reshape(batch, K)
    num_draft = torch.tensor(LENGTHS)
    drafts = torch.where(torch.arange(K) < num_draft[:, None], drafts, -1)
    return drafts, p, (None if point_mass else q), num_draft


def _assert_same(batched, alone, width):
    """``batched``: a row of a batch of width K (tensors sliced to that row); ``alone``: the row alone, width
    ``width``. Entries past the row's own width must be padding (-1 / False / 0 / NaN)."""
    for name in ("num_accepted", "num_emitted", "num_carried", "num_fallbacks"):
        if getattr(alone, name, None) is not None:
            assert torch.equal(getattr(batched, name), getattr(alone, name)), name
    for name, pad in [("tokens", -1), ("accept_mask", False), ("next_drafts", -1), ("next_q", 0.0)]:
        a, b = getattr(alone, name, None), getattr(batched, name, None)
        if a is None:
            continue
        w = a.shape[1]
        assert torch.equal(b[:, :w], a), name
        assert (b[:, w:] == pad).all(), name
    for name in ("accept_prob", "values"):
        a, b = getattr(alone, name), getattr(batched, name)
        if a is None:
            continue
        w = a.shape[1]
        torch.testing.assert_close(b[:, :w], a, rtol=0, atol=0, equal_nan=True)


def _row(result, b):
    """Row b of a result, as a batch of one."""
    out = type(result).__new__(type(result))
    for name, value in vars(result).items():
        setattr(out, name, value[b : b + 1] if isinstance(value, torch.Tensor) else value)
    return out


def _check_chain(call, inputs, **kwargs):
    drafts, p, q, num_draft = inputs
    gens = _gens()
    batched = call(drafts, p, q, generator=gens, num_draft=num_draft, **kwargs)
    for b, length in enumerate(LENGTHS):
        g = torch.Generator().manual_seed(SEEDS[b])
        alone = call(
            drafts[b : b + 1, :length],
            p[b : b + 1, : length + 1],
            None if q is None else q[b : b + 1, :length],
            generator=[g],
            **kwargs,
        )
        _assert_same(_row(batched, b), alone, length)
        assert torch.equal(gens[b].get_state(), g.get_state()), b


NB = codebook_neighbours(torch.randn(V, 3, generator=torch.Generator().manual_seed(1)), 3)
EMB = torch.randn(V, 3, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize(
    "name",
    ["exact", "relaxed", "relaxed_released", "grouped", "grouped_gstar", "jacobi", "jacobi_coupled", "jacobi_grouped"],
)
def test_chain_row_independent_of_batch(name, point_mass):
    inputs = _chain_inputs(seed=len(name), point_mass=point_mass)
    if name == "exact":
        _check_chain(verify_exact, inputs)
    elif name.startswith("relaxed"):
        resample = "released" if name.endswith("released") else "optimal"
        _check_chain(verify_relaxed, inputs, neighbours=NB, delta=0.2, resample=resample)
    elif name.startswith("grouped"):
        resample = "optimal" if name.endswith("gstar") else "released"
        _check_chain(verify_grouped, inputs, group_size=4, embeddings=EMB, resample=resample)
    else:
        rule = Grouped(group_size=3, prob_threshold=0.3) if name.endswith("grouped") else None
        _check_chain(verify_jacobi, inputs, coupling=name != "jacobi", rule=rule)


def test_chain_engine_row_independent_with_rule_objects():
    inputs = _chain_inputs(seed=3)

    def call(*args, **kwargs):
        return verify_chain(Lantern(NB, lam=3.0), *args, **kwargs)

    _check_chain(call, inputs)


# root -> 0, 1, 2; 0 -> 3, 4; 3 -> 5; 1 -> 6 (node i's parent is PARENTS[i]; nodes >= n_b are absent in row b)
PARENTS = torch.tensor([-1, -1, -1, 0, 0, 3, 1])
NODES = [7, 0, 3, 6, 1, 4, 7]  # present nodes per row: a prefix of the node list (trees of different depth/width)


def _tree_inputs(mode, seed=0):
    gen = torch.Generator().manual_seed(seed)
    batch, n = len(NODES), len(PARENTS)
    p = (torch.randn(batch, n + 1, V, generator=gen) * 1.5).softmax(-1)
    q = (torch.randn(batch, n, V, generator=gen) * 1.5).softmax(-1)
    if mode == "without_replacement":  # distinct siblings
        rank = torch.tensor([int((PARENTS[:i] == PARENTS[i]).sum()) for i in range(n)])
        tokens = (rank + torch.randint(0, V, (batch, 1), generator=gen)) % V
    else:
        tokens = torch.randint(0, V, (batch, n), generator=gen)
    tokens = torch.where(torch.arange(n) < torch.tensor(NODES)[:, None], tokens, -1)
    return tokens, p, (None if mode == "deterministic" else q)


@pytest.mark.parametrize("mode", ["deterministic", "iid", "without_replacement"])
@pytest.mark.parametrize("rule", [None, "relaxed", "grouped"])
@pytest.mark.parametrize("bounds", [None, (3, 3)])  # None: the walk; bounds: every row draws its grid of coins
def test_tree_row_independent_of_batch(mode, rule, bounds):
    tokens, p, q = _tree_inputs(mode, seed=len(mode))
    rule = {None: None, "relaxed": Lantern(NB, delta=0.3), "grouped": Grouped(group_size=3, delta=0.1)}[rule]
    gens = _gens()
    batched = verify_tree(tokens, PARENTS, p, q, mode=mode, generator=gens, rule=rule, bounds=bounds)
    for b, n in enumerate(NODES):
        g = torch.Generator().manual_seed(SEEDS[b])
        alone = verify_tree(
            tokens[b : b + 1, :n],
            PARENTS[:n],
            p[b : b + 1, : n + 1],
            None if q is None else q[b : b + 1, :n],
            mode=mode,
            generator=[g],
            rule=rule,
            bounds=bounds,
        )
        row = _row(batched, b)
        width = alone.path.shape[1]
        assert torch.equal(row.path[:, :width], alone.path) and (row.path[:, width:] == -1).all()
        _assert_same(row, alone, n)
        assert torch.equal(gens[b].get_state(), g.get_state()), b


@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("case", ["fallback", "many_tries"])
def test_continuous_row_independent_of_batch(prefix, case, monkeypatch):
    """Continuous tokens: coins, residual proposals (loop over chunks of tries) and fallback normals.

    ``"fallback"``: p ~ q and an offset of -0.5: ~40% rejections whose proposals are taken w.p. ~0.4, one try:
    fallbacks fire. ``"many_tries"``: drafts 20 below the draft mean are always rejected and p is very close to q
    (TV ~ 0.006), so residual proposals are rarely taken: rows need chunks of 16 tries past the first draw of
    `RESIDUAL_TRIES_AT_ONCE`, and rows done earlier must stop drawing while the others go on."""
    chunks = []  # per-row draw counts of each chunk of residual tries
    try_draws = continuous._try_draws

    def spy(tries, shape, generator, counts, dtype, device):
        chunks.append(counts if isinstance(counts, list) else counts.tolist())  # host counts with per-row generators
        return try_draws(tries, shape, generator, counts, dtype, device)

    monkeypatch.setattr(continuous, "_try_draws", spy)
    gen = torch.Generator().manual_seed(5)
    batch, d = len(LENGTHS), 3
    shape = (batch, K, d)
    mu_q = torch.randn(shape, generator=gen)
    sd = torch.full(shape, 0.6)
    if case == "fallback":
        x, mu_p, offset, tries = mu_q + sd * torch.randn(shape, generator=gen), mu_q + 1e-3, -0.5, 1
    else:
        x, mu_p, offset, tries = mu_q - 20, mu_q + 0.005, 0.0, 400
    offset = torch.full((batch, K), offset)
    num_draft = torch.tensor(LENGTHS)
    kwargs = dict(prefix=prefix, max_residual_tries=tries)
    gens = _gens()
    batched = verify_continuous(
        x, mu_p, sd, mu_q, sd, generator=gens, log_ratio_offset=offset, num_draft=num_draft, **kwargs
    )
    if case == "fallback":
        assert batched.num_fallbacks.sum() > 0
    else:  # per-row draw counts: a later chunk skips rows that are done although they have drafts
        assert len(chunks) >= 2
        assert any(later == 0 < first for first, later in zip(chunks[0], chunks[-1]))
    for b, length in enumerate(LENGTHS):
        g = torch.Generator().manual_seed(SEEDS[b])
        rows = (t[b : b + 1, :length] for t in (x, mu_p, sd, mu_q, sd))
        alone = verify_continuous(*rows, generator=[g], log_ratio_offset=offset[b : b + 1, :length], **kwargs)
        _assert_same(_row(batched, b), alone, length)
        assert torch.equal(gens[b].get_state(), g.get_state()), b


def test_single_generator_still_draws_the_whole_batch():
    """With one generator nothing changes: the batch draws every padded entry (counts are ignored)."""
    drafts, p, q, num_draft = _chain_inputs(seed=9)
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    verify_exact(drafts, p, q, generator=g1, num_draft=num_draft)
    torch.rand(len(LENGTHS), K, generator=g2)  # the coins
    torch.rand(len(LENGTHS), 1, generator=g2, dtype=torch.float64)  # one uniform per row for the correction / bonus
    assert torch.equal(g1.get_state(), g2.get_state())
