"""SJD-PAC: verification of a Jacobi *tree* (proactive drafting) and the coupled re-draft of its main branch.

Paper: SJD-PAC, "Accelerating Speculative Jacobi Decoding via Proactive Drafting and Adaptive Continuation"
(Kang et al., CVPR 2026, arXiv 2603.18599; release KangJialiang/SJD-PAC). Notation: ``p_target`` is the target's
processed distribution at a node (this round's forward), ``q_draft`` the law the node's sibling set was drawn from.

The proposal (`mmspec.drafters.jacobi_pac.ProactiveJacobiDrafter`) is a shallow wide tree rooted at the pending
token, followed by one chain out to the window length. The **main branch** is the first child of the root, then the
first child of each main node: it carries the Jacobi window ``d_1 .. d_L`` (laws ``q_1 .. q_L``, the previous round's
``p_target``). Every other node is a sibling drawn without replacement from its position's ``q_j``. Verification is
`verify_tree` in ``mode="without_replacement"`` (recursive rejection over siblings, RSD): lossless because each
sibling set is a without-replacement draw from the ``q_draft`` the verifier uses, fixed before the target looked.

*Adaptive continuation* is the coupled re-draft of the main branch: after the accepted path ends at depth ``a``
(``a`` drafts accepted, then the correction / bonus), window positions ``a+2 .. L`` keep their main draft ``d_j``
with probability ``min(1, p_j(d_j) / q_j(d_j))`` (a fresh coin: the verifier never tried these nodes, their parents
were not accepted) else take ``y ~ norm([p_j - q_j]_+)``, where ``p_j`` is this round's ``p_target`` at the main node
before position ``j``; position ``L+1`` is a fresh sample of ``p_target`` after the last main node. Marginally
``y_j ~ p_j`` (maximal coupling), which becomes the next round's ``q_j`` -- the same re-draft as SCD on a chain
(`mmspec.verify.jacobi.coupled_redraft`, SCD: So et al., arXiv 2510.24211), whatever branch the accepted path took.
"""

import functools

import torch
from torch import Tensor

from mmspec.random import Generators
from mmspec.verify.chain import chain_from_uniforms, verify_chain
from mmspec.verify.jacobi import carry_window, coupled_redraft
from mmspec.verify.registry import resolve_rule
from mmspec.verify.results import JacobiResult, VerifyResult
from mmspec.verify.rules import AcceptanceRule
from mmspec.verify.tree import tree_uniforms, uncached_in_graph, verify_tree


__all__ = ["jacobi_tree_uniforms", "main_branch", "verify_jacobi_tree"]


def main_branch(parents: Tensor | list[int]) -> list[int]:
    """The main branch of a Jacobi tree layout ``parents [N]`` (-1 = child of the pending token, topological
    order): the first child (lowest index) of the root, then the first child of each main node, as node indices
    (host list; one read of ``parents``)."""
    first: dict[int, int] = {}
    for i, par in enumerate(parents if isinstance(parents, list) else parents.tolist()):
        first.setdefault(par, i)
    nodes, cur = [], -1
    while cur in first:
        cur = first[cur]
        nodes.append(cur)
    return nodes


@functools.lru_cache(maxsize=64)
def _layout_bounds(layout: tuple[int, ...]) -> tuple[int, int]:
    """``(max depth, max children per node)`` of a host layout (depth 1 = a child of the pending token): the
    `verify_tree` loop bounds, computed once per layout."""
    depth, kids = [], [0] * (len(layout) + 1)  # kids[par + 1]: children of node par (the pending token's first)
    for par in layout:
        depth.append(1 if par < 0 else depth[par] + 1)
        kids[par + 1] += 1
    return (max(depth) if depth else 0), max(kids)  # plain lists: a captured round traces this


def _chain_tail(layout: list[int], main: list[int]) -> int:
    """Number of trailing nodes that form a chain under the main branch: each the next main node, the last nodes
    of the layout, and the only child of its parent."""
    n = len(layout)
    kids: dict[int, int] = {}
    for par in layout:
        kids[par] = kids.get(par, 0) + 1
    tail = 0
    while tail < len(main) - 1 and main[-1 - tail] == n - 1 - tail and kids[layout[n - 1 - tail]] == 1:
        tail += 1
    return tail


def _index_tensors(layout: tuple[int, ...], main: tuple[int, ...], tail: int, device: torch.device):
    """The layout's index tensors: ``main [L]`` (main-branch nodes), ``main_rows [L+1]`` (their p_target rows,
    the pending token's first), ``chain_rows [tail+1]`` (the chain's p_target rows, the anchor's first) and
    ``chain_nodes [tail]`` (the chain's p_target rows after each chain node, ``n0 + 1 + slot``)."""
    n = len(layout)
    n0 = n - tail
    anchor = main[len(main) - tail - 1] if tail else 0
    return (
        torch.tensor(main, dtype=torch.long, device=device),
        torch.tensor([0, *(m + 1 for m in main)], dtype=torch.long, device=device),
        torch.tensor([anchor + 1, *range(n0 + 1, n + 1)], dtype=torch.long, device=device),
        torch.arange(n0 + 1, n + 1, dtype=torch.long, device=device),
    )


_cached_index_tensors = functools.lru_cache(maxsize=64)(_index_tensors)


def jacobi_tree_uniforms(layout) -> int:
    """Uniforms per row a captured SJD-PAC round over the host `layout` takes (`verify_jacobi_tree(uniforms=...)`):
    the tree part's grid of coins + its emitted token's, the chain tail's coins + its next token's, then the
    main branch's re-draft: ``L`` coupling coins, ``L + 1`` fresh samples, ``L`` residual samples."""
    layout = list(layout)
    main = main_branch(layout)
    tail = _chain_tail(layout, main)
    n0 = len(layout) - tail
    bounds = uncached_in_graph(_layout_bounds)(tuple(layout[:n0]))
    return tree_uniforms(bounds) + (tail + 1 if tail else 0) + 3 * len(main) + 1


def _verify_tree_then_chain(tokens, layout, main, p_target, q_draft, generator, rule, validate, layout_list=None,
                            index=None, uniforms=None):  # fmt: skip
    """`verify_tree` (without replacement) over the whole Jacobi tree, computed as the tree part followed, for the
    rows whose path reached the main node the chain hangs from (the anchor), by `verify_chain` over the chain: the
    same recursion (a chain is a tree of single children), without a Python step per chain node and sibling slot.
    The tree part's emitted token of the rows that go on into the chain is discarded (an independent draw).
    `uniforms`: drawn beforehand (`jacobi_tree_uniforms`' first columns: the tree part's, then the chain's)."""
    batch, n = tokens.shape
    layout_list = layout.tolist() if layout_list is None else layout_list
    tail = _chain_tail(layout_list, main)
    if tail == 0:
        return verify_tree(tokens, layout, p_target, q_draft, mode="without_replacement", generator=generator,
                           rule=rule, validate=validate, bounds=uncached_in_graph(_layout_bounds)(tuple(layout_list)),
                           layout=tuple(layout_list), uniforms=uniforms)  # fmt: skip
    n0 = n - tail  # tree-part nodes
    anchor = main[len(main) - tail - 1]  # the main node the chain hangs from
    depth = len(main) - tail  # its depth
    bounds = uncached_in_graph(_layout_bounds)(tuple(layout_list[:n0]))
    u_tree = u_chain = None
    if uniforms is not None:
        u_tree, u_chain = uniforms[:, : tree_uniforms(bounds)], uniforms[:, tree_uniforms(bounds) :]
    tree = verify_tree(tokens[:, :n0], layout[:n0], p_target[:, : n0 + 1], q_draft[:, :n0],
                       mode="without_replacement", generator=generator, rule=rule, validate=validate,
                       bounds=bounds, layout=tuple(layout_list[:n0]), uniforms=u_tree)  # fmt: skip
    reached = tree.path.gather(1, tree.num_accepted[:, None])[:, 0] == anchor + 1  # [B]
    chain_tokens = tokens[:, n0:]
    present = (chain_tokens >= 0).long().cumprod(1).sum(1)
    if index is None:
        index = _index_tensors(tuple(layout_list), tuple(main), tail, p_target.device)
    rows, chain_nodes = index[2], index[3]
    if u_chain is None:
        chain = verify_chain(rule, chain_tokens.clamp(min=0), p_target.index_select(1, rows), q_draft[:, n0:],
                             generator=generator, num_draft=present * reached, validate=validate)  # fmt: skip
    else:
        chain = chain_from_uniforms(rule, chain_tokens.clamp(min=0), p_target.index_select(1, rows), q_draft[:, n0:],
                                    present * reached, u_chain)  # fmt: skip
    width = depth + tail + 1
    out = torch.full((batch, width), -1, dtype=torch.long, device=tokens.device)
    path = torch.full((batch, width), -1, dtype=torch.long, device=tokens.device)
    w = tree.tokens.shape[1]
    out[:, :w], path[:, :w] = tree.tokens, tree.path
    out[:, depth:] = torch.where(reached[:, None], chain.tokens, out[:, depth:])
    chain_path = torch.where(chain_nodes < chain.num_accepted[:, None] + n0 + 1, chain_nodes, -1)
    path[:, depth + 1 :] = torch.where(reached[:, None], chain_path, path[:, depth + 1 :])
    return VerifyResult(
        num_accepted=tree.num_accepted + chain.num_accepted * reached,
        accept_mask=torch.cat([tree.accept_mask, chain.accept_mask & reached[:, None]], dim=1),
        tokens=out,
        path=path,
        accept_prob=torch.cat(
            [
                tree.accept_prob,
                chain.accept_prob.masked_fill(~reached[:, None], float("nan")),
            ],
            1,
        ),
    )


def verify_jacobi_tree(
    tree_tokens: Tensor,
    parents: Tensor,
    p_target: Tensor,
    q_draft: Tensor,
    *,
    generator: Generators,
    coupling: bool = True,
    rule: AcceptanceRule | None = None,
    validate: bool = True,
    layout: list[int] | None = None,
    uniforms: Tensor | None = None,
) -> JacobiResult:
    """One SJD-PAC step: verify a Jacobi tree, then re-draft the main branch (module docstring).

    RNG: `verify_tree`'s draws (one coin per tried node, one per row for the emitted token), then the fresh samples
    ``[B, L+1]`` (row b draws ``L_b + 1``), then with coupling the coins and the residual samples ``[B, L]`` (row b
    draws ``L_b`` of each).

    Args:
        tree_tokens: ``[B, N]`` tree nodes (-1 = absent: ragged rows); parents: ``[N]`` (or ``[B, N]`` with equal
            rows): -1 = child of the pending token, topological order; a node's first child is its main-branch
            child.
        p_target: ``[B, N+1, V]`` this round's distributions (row 0 after the pending token, row ``i+1`` after node i).
        q_draft: ``[B, N, V]`` the law node i's sibling set was drawn from, without replacement, in index order
            (on the main branch: the window's ``q_j``, the main draft first).
        generator: one ``torch.Generator`` or one per row; coupling: maximal-coupling re-draft (SCD) or independent
            samples (SJD); rule: the acceptance rule (default `Exact`); validate: as `verify_tree`.
        layout: the layout ``parents[0]`` as a host list, when the caller has it (the drafter built it): then the
            step reads nothing from the device for the tree's shape (main branch, loop bounds).
        uniforms: ``[B, jacobi_tree_uniforms(layout)]`` float64 uniforms drawn beforehand (with `layout` and
            ``validate=False``; `generator` unused): every draw of the step, each token the inverse CDF of its law at
            its uniform -- what a captured graph runs (`mmspec.decoding.captured_verify`). The same law, another
            stream.

    Returns:
        `JacobiResult` with ``path`` (as `verify_tree`: rows of ``p_target`` on the accepted path, for the target's
        ``commit_path``), ``next_drafts [B, L]`` / ``next_q [B, L, V]`` / ``num_carried [B]`` (as `verify_jacobi`:
        the main branch's re-drafts for positions ``a+2 .. L_b+1``, left-aligned; ``L_b - a`` carried).
    """
    rule = resolve_rule(rule, "exact", "optimal", {})
    batch, n = tree_tokens.shape
    parents_row = parents if parents.ndim == 1 else parents[0]
    if validate and parents.ndim == 2 and not bool((parents == parents_row).all()):
        raise ValueError("parents: a Jacobi tree has one layout for every row (absent nodes are tree_tokens -1)")
    if layout is not None and validate and parents_row.tolist() != list(layout):
        raise ValueError("layout must be parents[0] as a list")
    layout_list = parents_row.tolist() if layout is None else list(layout)
    main_list = main_branch(layout_list)
    # the layout's index tensors: once per layout when the drafter gave it as a host list
    key = (tuple(layout_list), tuple(main_list), _chain_tail(layout_list, main_list), tree_tokens.device)
    index = _index_tensors(*key) if layout is None else uncached_in_graph(_cached_index_tensors)(*key)
    u_verify = u_redraft = None
    if uniforms is not None:
        if layout is None or validate:
            raise ValueError("uniforms need the host layout and validate=False (a captured round reads nothing)")
        split = jacobi_tree_uniforms(layout_list) - (3 * len(main_list) + 1)
        u_verify, u_redraft = uniforms[:, :split], uniforms[:, split:]
    res = _verify_tree_then_chain(tree_tokens, parents_row, main_list, p_target, q_draft, generator, rule, validate,
                                  layout_list, index, u_verify)  # fmt: skip
    main, rows = index[0], index[1]  # [L] main-branch nodes, [L+1] p rows for positions 1 .. L+1
    drafts = tree_tokens.index_select(1, main)  # [B, L]
    # a row's main branch ends at its first absent main node
    lengths = (drafts >= 0).long().cumprod(1).sum(1)  # [B]
    p = p_target.to(res.accept_prob.dtype)
    p_main = p.index_select(1, rows)  # [B, L+1, V]
    d_main = drafts.clamp(min=0)  # [B, L]
    q_main = q_draft.to(p.dtype).index_select(1, main)  # [B, L, V]

    # adaptive continuation: SCD's coupled re-draft (fresh coins: the verifier never tried these nodes)
    if u_redraft is None:
        redraft = coupled_redraft(p_main, q_main, d_main, lengths, generator, coupling=coupling)  # [B, L+1]
    else:  # the coupling's coins, then the fresh and residual samples' uniforms
        size = len(main_list)
        redraft = coupled_redraft(p_main, q_main, d_main, lengths, None, coupling=coupling,
                                  coins=u_redraft[:, :size], uniforms=u_redraft[:, size:])  # fmt: skip
    return JacobiResult.carrying(res, *carry_window(redraft, p_main, res.num_accepted, lengths))
