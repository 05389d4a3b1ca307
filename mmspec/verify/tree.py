"""Tree verification by recursive rejection sampling over siblings.

Papers: SpecInfer (Miao et al., arXiv 2305.09781: multi-step speculative sampling over i.i.d. children), EAGLE-2
(Li et al., arXiv 2406.16858: deterministic top-k children, ``evaluate_posterior``), RSD (Jeon et al.,
arXiv 2402.14160: siblings drawn without replacement). At a node with target residual ``r`` (``p_target`` there
before any sibling was tried), children ``c_1, c_2, ...`` are tried in order: ``c_j`` is accepted with the rule's
``accept(r, q_j, c_j)``, otherwise ``r <- residual(r, q_j, c_j)`` (`AcceptanceRule.step`). An accepted child is
descended into; a node with no accepted child emits ``y ~ r`` and stops. By induction over siblings every emitted
token is distributed as ``p_target`` (exact rule), because the tree shape never depends on target coins.
"""

import functools

import torch
from torch import Tensor

from mmspec.counting import host_checks_enabled
from mmspec.random import Generators, check_generator, num_rows, rand
from mmspec.sampling import inverse_cdf, prob_dtype, sample
from mmspec.verify.checks import (
    Checks,
    check_choice,
    check_shape,
    check_tokens_and_probs,
    gather_last,
    normalize,
    raise_first,
)
from mmspec.verify.registry import resolve_rule
from mmspec.verify.results import VerifyResult
from mmspec.verify.rules import AcceptanceRule


__all__ = ["TREE_MODES", "tree_from_uniforms", "tree_uniforms", "verify_tree"]

TREE_MODES = ("deterministic", "iid", "without_replacement")


def _tree_children(
    parents: Tensor,
    present: Tensor,
    validate: bool,
    checks: Checks,
    bounds: tuple[int, int] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int]:
    """The tree's structure in a fixed number of batched ops (no per-node or per-level loop).

    Returns `(parents [B, N]` clamped to [-1, N-1]; `children [B, N+1, C]` node indices of the children of each p_target row in index order, -1 padded;
    `rank [B, N]` earlier present siblings of each node; `depth [B, N]` (1 = child of the root); `ancestry
    [B, N, N]` (`[b, i, j]`: j is i or an ancestor of i); `earlier [B, N, N]` (`[b, i, j]`: j is an earlier present
    sibling of i); max depth`)`. One host sync (validation flags + loop bounds) -- none where `bounds` (host-known
    upper bounds on the depth and the children per node) are given, nothing is validated and a read is not free (an
    accelerator) or inside a captured graph (which reads nothing): the bounds are then used as they are (the extra
    steps try no child)."""
    batch, n = present.shape
    device = parents.device
    node = torch.arange(n, device=device)
    if validate:
        checks.add(((parents < -1) | (parents >= node)).any(), "parents[i] must be -1 (root) or in [0, i-1]")
        par_present = present.gather(1, parents.clamp(0, max(n - 1, 0))) | (parents < 0)
        checks.add((present & ~par_present).any(), "a present node has an absent parent (tree_tokens -1)")
    parents = parents.clamp(-1, n - 1)
    earlier = (parents[:, :, None] == parents[:, None, :]) & (present[:, None, :] & (node[None, :] < node[:, None]))
    rank = earlier.sum(-1)  # earlier present siblings of node i  [B, N]
    # ancestor-or-self relation: the reflexive-transitive closure of the parent relation, by squaring it
    # ceil(log2(N)) times (exact: small integer counts in float32); depth = ancestors-or-self
    rel = (
        torch.eye(n, dtype=torch.float32, device=device)
        .expand(batch, n, n)
        .scatter_add(2, parents.clamp(min=0)[..., None], (parents >= 0).float()[..., None])
    )
    for _ in range(max(n - 1, 1).bit_length()):
        rel = torch.bmm(rel, rel).clamp_(max=1)
    ancestry = rel > 0
    depth = ancestry.sum(-1)
    if bounds is not None and not validate and (torch.compiler.is_compiling() or not host_checks_enabled(device)):
        depth_bound, width = min(int(bounds[0]), n), min(int(bounds[1]), n)
    else:
        zero = torch.zeros((), dtype=torch.long, device=device)
        max_depth = torch.where(present, depth, 0).amax() if n else zero
        max_children = torch.where(present, rank + 1, 0).amax() if n else zero
        values = torch.stack([f.to(torch.long) for f in checks.flags] + [max_depth, max_children]).tolist()
        raise_first(values[:-2], checks.messages)
        width, depth_bound = int(values[-1]), int(values[-2])
        if bounds is not None and (depth_bound > bounds[0] or width > bounds[1]):
            raise ValueError(f"bounds {tuple(bounds)} below the tree's depth {depth_bound} / children {width}")
    # children[b, row, slot]; absent nodes are written to a dump slot that is cut off.
    children = torch.full((batch, (n + 1) * (width + 1)), -1, dtype=torch.long, device=device)
    flat = torch.where(present, (parents + 1) * (width + 1) + rank, (width + 1) * (n + 1) - 1)
    children.scatter_(1, flat, torch.where(present, node, -1).expand(batch, n).contiguous())
    children = children.view(batch, n + 1, width + 1)[..., :width]
    return parents, children, rank, depth, ancestry, earlier, depth_bound


def tree_uniforms(bounds: tuple[int, int]) -> int:
    """Uniforms per row a tree round with host bounds ``(depth, children per node)`` takes in `tree_from_uniforms`:
    the grid of coins, then the emitted token's."""
    return int(bounds[0]) * int(bounds[1]) + 1


def tree_from_uniforms(
    rule: AcceptanceRule,
    tree_tokens: Tensor,
    parents: Tensor,
    p_target: Tensor,
    bounds: tuple[int, int],
    uniforms: Tensor | None,
) -> VerifyResult:
    """`verify_tree` (``mode="deterministic"``: EAGLE-2's top-k children, point-mass drafts; unvalidated; the tree
    bounded by the host-known `bounds`) as a pure tensor function of pre-drawn uniforms: what a captured graph runs
    (`mmspec.decoding.captured_verify`). Recursive rejection over siblings as `verify_tree` (Chen et al. 2023;
    SpecInfer; EAGLE-2's ``evaluate_posterior``) with `rule`.

    ``uniforms [B, tree_uniforms(bounds)]`` (float64; None: greedy decoding): node i takes the coin of (its depth,
    its rank among its siblings) from the row's grid, the emitted token is the inverse CDF of its distribution at
    the last uniform: the per-row-generator layout of `verify_tree`, so the law is `verify_tree`'s (each coin used
    once), drawn in one go. Absent nodes (-1) are never tried."""
    return verify_tree(tree_tokens, parents, p_target, mode="deterministic", generator=None, greedy=uniforms is None,
                       rule=rule, validate=False, bounds=bounds, uniforms=uniforms)  # fmt: skip


def uncached_in_graph(fn):
    """`fn` (an `lru_cache`d pure function of host values), or what it wraps while dynamo traces a captured round
    (which would ignore the cache and warn)."""
    return fn.__wrapped__ if torch.compiler.is_compiling() else fn


@functools.lru_cache(maxsize=64)
def _layout_structure(layout: tuple[int, ...], bounds: tuple[int, int], device: torch.device):
    """`_tree_children` of a host layout with every node present, once per (layout, bounds, device): the
    structure of a drafter's fixed layout is not rebuilt every round. Shapes with a batch dim of 1; ``children``
    holds every node of the layout (a round's absent nodes are masked by the caller)."""
    n = len(layout)
    parents = torch.tensor(layout, dtype=torch.long, device=device)[None]
    present = torch.ones((1, n), dtype=torch.bool, device=device)
    with torch.inference_mode(False):
        parents, children, rank, depth, ancestry, earlier, _ = _tree_children(
            parents, present, False, Checks(), bounds
        )
    return parents, children, rank, depth, ancestry, earlier


def verify_tree(
    tree_tokens: Tensor,
    parents: Tensor,
    p_target: Tensor,
    q_draft: Tensor | None = None,
    *,
    mode: str = "deterministic",
    generator: Generators,
    greedy: bool = False,
    rule: AcceptanceRule | None = None,
    acceptance: str = "exact",
    resample: str = "optimal",
    validate: bool = True,
    bounds: tuple[int, int] | None = None,
    layout: tuple[int, ...] | None = None,
    uniforms: Tensor | None = None,
    **knobs,
) -> VerifyResult:
    """Tree verification by recursive rejection sampling over siblings (module docstring).

    Modes, i.e. how the children were drawn (the tree shape must not depend on target coins):

    * ``"deterministic"``: top-k / fixed children, ``q`` = point mass (``q_draft`` must be None): accept with
      ``r(c)``, on reject zero ``c`` and renormalise (EAGLE-2 ``evaluate_posterior``). Duplicates are fine.
    * ``"iid"``: children drawn i.i.d. from ``q_draft[:, i]`` (SpecInfer multi-step speculative sampling).
    * ``"without_replacement"``: the sibling set was drawn without replacement from ``q_draft[:, i]`` (RSD;
      EAGLE-1 static-tree sampling); sibling j is checked against the conditional
      ``q_j = q 1[x not in earlier siblings] / (1 - q(earlier siblings))``. Siblings must be distinct.

    ``rule`` plugs any acceptance rule into the same recursion: `Exact` (default; lossless), `Lantern` /
    `Grouped` (the numerator / group masses are computed on the current residual ``r``, as in LANTERN's
    dynamic-tree code). ``greedy=True``: accept the first child passing ``rule.greedy_accept`` (exact: equal to
    ``argmax p``) and emit the argmax; no randomness.

    RNG: one uniform per tried child (a row with no child to try at a step draws nothing there), then one uniform
    per row for the emitted token.

    Args:
        tree_tokens: ``[B, N]`` node tokens; -1 marks an absent node (ragged trees; its children must be absent).
        parents: ``[N]`` or ``[B, N]``: ``parents[i] = -1`` (child of the root) or an earlier node in ``[0, i)``.
        p_target: ``[B, N+1, V]``; index 0 = target distribution at the root, index ``i+1`` = after node i
            (greedy: probabilities or logits).
        q_draft: ``[B, N, V]`` draft distribution node i was drawn from (``iid``) / its sibling set was drawn
            from (``without_replacement``), or None (``deterministic``).
        mode, greedy: see above.
        rule: the acceptance rule; or the string form ``acceptance`` / ``resample`` / ``knobs`` (`make_rule`),
            kept for compatibility.
        generator, validate: as `verify_chain`.
        bounds: optional host-known ``(max depth, max children per node)`` of the tree (e.g. the drafter's
            ``tree_depth`` / ``tree_top_k``): with ``validate=False`` on an accelerator the loop runs to these
            bounds instead of reading the tree's (no host read); where a read is free (CPU) the exact bounds are read
            and checked against them. A row's draws do not depend on the bounds with per-row generators; with one
            generator the extra steps draw coins (same law, another stream than the exact bounds').
        layout: optional host tuple equal to every row of ``parents``, whose sibling sets have their absent nodes
            last (SJD-PAC's drafter): with `bounds`, ``validate=False`` and one generator on an accelerator, the
            tree's structure comes from a per-layout cache instead of being rebuilt (the same result).
        uniforms: ``[B, tree_uniforms(bounds)]`` float64 uniforms drawn beforehand (needs `bounds` and
            ``validate=False``; `generator` unused): the per-row grid of coins and the emitted token's uniform, read
            nothing from the device (what a captured graph runs: `tree_from_uniforms`, SJD-PAC's
            `mmspec.verify.jacobi_tree.verify_jacobi_tree`). The same law; the layout of per-row generators.

    Returns:
        `VerifyResult` with ``path [B, D+1]`` (rows of ``p_target``: 0 = root, then ``1 + node`` per accepted
        node, -1 padded), ``tokens [B, D+1]`` (accepted tokens along the path, the emitted token at index
        ``num_accepted``, -1 after), ``accept_mask [B, N]`` (accepted nodes), ``accept_prob [B, N]`` (NaN where a
        node was never tried); ``D`` = tree depth.
    """
    check_choice("mode", mode, TREE_MODES)
    rule = resolve_rule(rule, acceptance, resample, knobs)
    batch, n, vocab = check_tokens_and_probs("tree_tokens", tree_tokens, p_target, "N")
    if parents.ndim == 1:
        check_shape("parents", parents, (n,))
        parents = parents[None].expand(batch, n)
    else:
        check_shape("parents", parents, (batch, n))
    parents = parents.to(device=p_target.device, dtype=torch.long)
    if mode == "deterministic" and q_draft is not None:
        raise ValueError("q_draft must be None for mode='deterministic' (children are point masses)")
    if mode != "deterministic" and q_draft is None and not greedy:
        raise ValueError(f"q_draft [B, N, V] is required for mode={mode!r}")
    check_generator(generator, batch, p_target.device)
    checks = Checks()
    rule.check(vocab, checks if validate else None)
    p = p_target.to(prob_dtype(p_target.dtype))
    q = None if (q_draft is None or greedy) else q_draft.to(p.dtype)
    if q_draft is not None and not greedy:
        check_shape("q_draft", q_draft, (batch, n, vocab))
    present = tree_tokens >= 0  # [B, N]
    tokens = tree_tokens.clamp(0, vocab - 1)
    if validate:
        checks.add((tree_tokens >= vocab).any(), f"tree_tokens out of range [-1 (absent), {vocab})")
        valid_p = torch.cat([torch.ones_like(present[:, :1]), present], dim=1)  # [B, N+1]
        if greedy:  # greedy trees accept logits
            checks.not_nan("p_target", p)
        else:
            checks.probs("p_target", p, valid_p, p_target.dtype)
        if q is not None:
            checks.probs("q_draft", q, present, q_draft.dtype)
            checks.add(
                ((gather_last(q, tokens) <= 0) & present).any(),
                "q_draft is 0 at a draft token (a draft cannot have been sampled from q_draft)",
            )
        if mode == "without_replacement":
            sib = (parents[:, :, None] == parents[:, None, :]) & present[:, :, None] & present[:, None, :]
            dup = sib & (tokens[:, :, None] == tokens[:, None, :])
            dup = dup & ~torch.eye(n, dtype=torch.bool, device=p.device)
            checks.add(dup.any(), "mode='without_replacement' needs distinct siblings")
    # per-row generators draw a fixed grid of coins per row, sized by the host-known bounds (`_all_nodes`); without
    # bounds, the walk down the tree draws only where a row tries a child
    grid = None if greedy or num_rows(generator) is None or bounds is None else (int(bounds[0]), int(bounds[1]))
    drawn = uniforms is not None and not greedy  # the coins and the token's uniform come with the call
    if drawn:
        if bounds is None or validate:
            raise ValueError("uniforms need the tree's bounds and validate=False (a captured round reads nothing)")
        grid = (int(bounds[0]), int(bounds[1]))
    cached = layout is not None and bounds is not None and not validate
    cached = cached and (torch.compiler.is_compiling() or not host_checks_enabled(p.device))
    if cached:  # the layout's structure, once; a round's absent nodes (last among their siblings) masked here
        structure = uncached_in_graph(_layout_structure)(tuple(layout), (int(bounds[0]), int(bounds[1])), p.device)
        parents, children, rank, depth, ancestry, earlier = (t.expand(batch, *t.shape[1:]) for t in structure)
        max_depth = min(int(bounds[0]), n)
        width = children.shape[-1]
        has = (children >= 0) & present.gather(1, children.clamp(min=0).view(batch, -1)).view(batch, n + 1, width)
        return _all_nodes(rule, mode, greedy, tokens, present, parents, children, rank, depth, ancestry, earlier,
                          p, q, generator, max_depth, has, grid, uniforms if drawn else None)  # fmt: skip
    parents, children, rank, depth, ancestry, earlier, max_depth = _tree_children(
        parents, present, validate, checks, bounds
    )
    if not greedy and num_rows(generator) is not None and grid is None:
        # per-row generators and no bounds: a row draws a coin only for the children it tries, so its stream
        # depends on the outcomes; the walk down the tree, one sibling at a time
        return _walk(rule, mode, tokens, children, p, q, generator, max_depth)
    return _all_nodes(rule, mode, greedy, tokens, present, parents, children, rank, depth, ancestry, earlier, p, q,
                      generator, max_depth, None, grid, uniforms if drawn else None)  # fmt: skip


def _all_nodes(rule, mode, greedy, tokens, present, parents, children, rank, depth, ancestry, earlier, p, q,
               generator, max_depth, has=None, grid=None, uniforms=None):  # fmt: skip
    """`verify_tree` for every node at once: a fixed number of batched ops per sibling slot (no walk per level).

    Each node's acceptance probability given that its earlier siblings were rejected is the rule's step on its
    parent's residual after those siblings; the step runs for every parent at once, one sibling slot at a time.
    Node i then takes the coin the walk down the tree would have given it -- with one generator the walk draws one
    coin per row at every (level, slot) step whether or not the row tries a child there, so all coins are drawn
    up front in that order and node i takes the one of (its depth, its rank) -- and is accepted locally with the
    rule's test. It is on the accepted path if it and each of its ancestors is the first locally accepted child of
    its parent; a row emits from its last path node's residual after all of that node's children were rejected
    (its target distribution at a leaf). The same draws, the same floating-point steps: bitwise the walk's result.
    Per-row generators (`grid = (depth bound, children bound)`, host-known): every row draws the whole grid of coins
    from its own generator, whatever its tree and the other rows' trees, and node i takes the coin of (its depth,
    its rank) -- i.i.d. uniforms used once each, so the law is the walk's, and a row's stream never depends on its
    batch. `uniforms [B, grid[0] * grid[1] + 1]` (float64, with `grid`): the grid of coins and the emitted token's
    uniform drawn beforehand (no generator: `tree_from_uniforms`, a captured graph); the token is then the inverse CDF
    of its distribution at that uniform.
    """
    batch, n1, vocab = p.shape
    n = n1 - 1
    width = children.shape[-1]
    device = p.device
    has = children >= 0 if has is None else has  # [B, N+1, C] children to try
    kids = children.clamp(min=0)
    xs = tokens.gather(1, kids.view(batch, n1 * width)).view(batch, n1, width)  # [B, N+1, C] child tokens
    resid = p  # [B, N+1, V]: the residual of every parent after the slots so far
    q_kids = None
    if q is not None and not greedy and width:  # [B, N+1, C, V] the draft law of every child, one gather
        q_kids = q.gather(1, kids.view(batch, n1 * width, 1).expand(batch, n1 * width, vocab)).view(
            batch, n1, width, vocab
        )
    # without replacement: the tokens of the earlier siblings (a parent with no child at a slot has none after it
    # either, so marking its rows unconditionally changes only steps whose results are never used)
    removed = None
    probs = []
    for slot in range(width):
        x = xs[..., slot]
        if greedy:
            probs.append(rule.greedy_accept(resid, x).to(p.dtype))
            continue
        q_child = None
        if q_kids is not None:
            q_child = q_kids[:, :, slot]  # [B, N+1, V]
            if mode == "without_replacement":
                masked = q_child if removed is None else q_child.masked_fill(removed, 0.0)
                q_child = normalize(masked, q_child)
                if slot + 1 < width:
                    removed = torch.zeros(p.shape, dtype=torch.bool, device=device) if removed is None else removed
                    removed = removed.scatter(2, x[..., None], True)
        a, next_resid = rule.step(resid, q_child, x)
        probs.append(a)
        resid = torch.where(has[..., slot, None], next_resid, resid)
    # node i's acceptance probability: slot rank(i) of its parent's row (p_target row parents + 1)
    a_node = torch.stack(probs, 1).view(batch, width * n1) if width else p.new_zeros(batch, 1)
    at = (rank.clamp(max=max(width - 1, 0)) * n1 + parents + 1).clamp(0, max(width * n1 - 1, 0))
    a_node = a_node.gather(1, at) if n else a_node[:, :0]  # [B, N]
    if greedy:
        ok = present & (a_node > 0)
    elif grid is not None:  # per-row generators: each row's own grid of coins
        if uniforms is None:
            coins = rand((batch, grid[0] * grid[1]), generator, device=device, dtype=p.dtype)
        else:
            coins = uniforms[:, : grid[0] * grid[1]]
        step = ((depth - 1) * grid[1] + rank).clamp(0, max(grid[0] * grid[1] - 1, 0))
        ok = present & (coins.gather(1, step) < a_node)
    elif max_depth * width:
        coins = rand((max_depth, width, batch), generator, device=device, dtype=p.dtype)  # the walk's draws
        step = ((depth - 1) * width + rank).clamp(0, max_depth * width - 1)
        ok = present & (coins.view(max_depth * width, batch).t().gather(1, step) < a_node)
    else:
        ok = present & False
    chosen = ok & ~(earlier & ok[:, None, :]).any(-1)  # the first locally accepted child of its parent
    on_path = ~(ancestry & ~chosen[:, None, :]).any(-1)  # [B, N] accepted nodes
    parent_on = torch.cat([torch.ones_like(on_path[:, :1]), on_path], 1).gather(1, parents + 1)
    tried = present & parent_on & ~(earlier & ok[:, None, :]).any(-1)
    num_acc = on_path.sum(1)
    # the path and its tokens, one scatter each (column `max_depth + 1`: a dump for the nodes off the path)
    # (column = depth; `max_depth + 2`: a dump for the nodes off the path, cut off)
    column = torch.where(on_path, depth, max_depth + 2)
    node = torch.arange(1, n1, device=device).expand(batch, n)
    blank = torch.full((batch, max_depth + 3), -1, dtype=torch.long, device=device)
    path = blank.scatter(1, column, node).index_fill(1, torch.zeros(1, dtype=torch.long, device=device), 0)
    out = blank.scatter(1, column, tokens.long())  # out[:, 1 + k]: the token of path row k + 1
    last = path.gather(1, num_acc[:, None])  # [B, 1] p_target row of the last accepted node (0 = root)
    final = resid.gather(1, last[..., None].expand(batch, 1, vocab)).squeeze(1)  # [B, V]
    if greedy:
        next_token = final.argmax(-1)
    elif uniforms is not None:
        next_token = inverse_cdf(final, uniforms[:, -1:])
    else:
        next_token = sample(final, generator)
    out = out.scatter(1, num_acc[:, None] + 1, next_token[:, None])
    return VerifyResult(
        num_accepted=num_acc,
        accept_mask=on_path,
        tokens=out[:, 1 : max_depth + 2],
        path=path[:, : max_depth + 1],
        accept_prob=torch.where(tried, a_node, float("nan")),
    )


def _walk(rule, mode, tokens, children, p, q, generator, max_depth):
    """`verify_tree` as a walk down the tree: at each level every row tries its current node's children one slot at
    a time (per-row generators: a row draws a coin only where it tries a child)."""
    batch, n1, vocab = p.shape
    n = n1 - 1
    width = children.shape[-1]
    rows = torch.arange(batch, device=p.device)
    cur = torch.zeros(batch, dtype=torch.long, device=p.device)  # p_target row of the current node (0 = root)
    resid = p[:, 0]  # [B, V]
    removed = torch.zeros(batch, vocab, dtype=torch.bool, device=p.device)  # tried siblings (without_replacement)
    done = torch.zeros(batch, dtype=torch.bool, device=p.device)
    final = resid
    num_acc = torch.zeros(batch, dtype=torch.long, device=p.device)
    path = torch.full((batch, max_depth + 1), -1, dtype=torch.long, device=p.device)
    path[:, 0] = 0
    out = torch.full((batch, max_depth + 1), -1, dtype=torch.long, device=p.device)
    accept_mask = torch.zeros(batch, n + 1, dtype=torch.bool, device=p.device)  # last column: dump slot
    accept_prob = torch.full((batch, n + 1), float("nan"), dtype=p.dtype, device=p.device)
    for depth in range(max_depth):
        kids = children.gather(1, cur.view(batch, 1, 1).expand(batch, 1, width)).squeeze(1)  # [B, C]
        found = torch.zeros(batch, dtype=torch.bool, device=p.device)
        chosen = torch.zeros(batch, dtype=torch.long, device=p.device)
        probs_here = torch.full((batch, width), float("nan"), dtype=p.dtype, device=p.device)  # [B, C]
        for slot in range(width):
            child = kids[:, slot].clamp(min=0)  # [B]
            active = (kids[:, slot] >= 0) & ~done & ~found  # [B] rows with a child to try here
            x = tokens.gather(1, child[:, None]).squeeze(1)  # [B]
            q_child = None
            if q is not None:
                q_child = q.gather(1, child.view(batch, 1, 1).expand(batch, 1, vocab)).squeeze(1)  # [B, V]
                if mode == "without_replacement":
                    q_child = normalize(q_child.masked_fill(removed, 0.0), q_child)
            a, next_resid = rule.step(resid, q_child, x)
            coins = rand((batch,), generator, device=p.device, dtype=p.dtype, counts=active.long())  # [B]
            acc = active & (coins < a)
            probs_here[:, slot] = torch.where(active, a, float("nan"))
            rejected = active & ~acc
            resid = torch.where(rejected[:, None], next_resid, resid)
            if mode == "without_replacement":
                removed.scatter_(1, x[:, None], rejected[:, None] | removed.gather(1, x[:, None]))
            found |= acc
            chosen = torch.where(acc, child, chosen)
        tried = ~torch.isnan(probs_here)
        accept_prob.scatter_(1, torch.where(tried, kids, n), probs_here)
        stop = ~done & ~found
        final = torch.where(stop[:, None], resid, final)
        done = done | stop
        adv = found  # rows descending into an accepted child
        path[:, depth + 1] = torch.where(adv, chosen + 1, -1)
        out[:, depth] = torch.where(adv, tokens.gather(1, chosen[:, None]).squeeze(1), out[:, depth])
        accept_mask.scatter_(1, torch.where(adv, chosen, n)[:, None], True)
        num_acc = num_acc + adv.long()
        cur = torch.where(adv, chosen + 1, cur)
        resid = torch.where(adv[:, None], p.gather(1, cur.view(batch, 1, 1).expand(batch, 1, vocab)).squeeze(1), resid)
        removed = removed & ~adv[:, None]
    final = torch.where(done[:, None], final, resid)  # rows that reached a leaf: bonus from p at the leaf
    out[rows, num_acc] = sample(final, generator)
    return VerifyResult(
        num_accepted=num_acc,
        accept_mask=accept_mask[:, :n],
        tokens=out,
        path=path,
        accept_prob=accept_prob[:, :n],
    )
