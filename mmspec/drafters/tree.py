"""EAGLE-2 dynamic draft-tree growth (Li et al. 2024, "EAGLE-2", arXiv 2406.16858), independent of what drafts.

`grow_tree` owns the tree bookkeeping -- frontier selection by cumulative draft log-probability, the ancestor masks
of the nodes fed so far, the global rerank -- and calls back into the drafter to score a frontier. The EAGLE head
(`mmspec.drafters.eagle.draft_tree`) and a draft LM (`mmspec.drafters.text_model.TextModelDrafter`) share it.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch

from mmspec.counting import host_checks_enabled


__all__ = ["DraftTree", "grow_tree"]


class DraftTree(NamedTuple):
    """A draft token tree per batch item, nodes in topological order (`parents[b, i] < i`, `-1` = child of root).

    tokens: `[B, N]` draft tokens; parents: `[B, N]`; depths: `[B, N]` (1 = child of the root);
    scores: `[B, N]` cumulative draft log-probabilities.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor


# expand(tokens [B, k], parent [B, k] | None, ancestry [B, k, n_fed + k], depth) -> log q_draft [B, k, V]
Expand = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, int], torch.Tensor]


def grow_tree(root_log_probs: torch.Tensor, expand: Expand, *, depth: int, top_k: int, total: int) -> DraftTree:
    """Grow an EAGLE-2 tree of `depth` levels from the root's draft log-probabilities `[B, V]`.

    1. depth 1: the root's `top_k` best tokens (scores = their log-probs) form the frontier.
    2. depth d = 2..`depth`: `expand(tokens, parent, ancestry, d)` feeds the frontier (`top_k` nodes at depth d - 1)
       to the drafter and returns their log-probabilities `[B, k, V]`. `parent[b, i]` indexes the node of the
       *previous* `expand` call this node is a child of (`None` on the first call: all are children of the root);
       `ancestry[b, i, j]`: fed node j (in feeding order, this call's nodes last) is node i or an ancestor of it --
       the drafter writes this call's nodes after the `n_fed` earlier ones and masks attention with it. Every frontier
       node proposes its `top_k` children, scored by cumulative log-prob; the best `top_k` form the next frontier.
    3. All candidates are reranked by cumulative log-prob (ties: shallower first) and `total` kept -- an
       ancestor-closed set, since a child never scores above its parent -- returned in topological order.
    """
    if depth < 1 or top_k < 1 or total < 1:
        raise ValueError(f"depth, top_k and total must be >= 1, got {depth}, {top_k}, {total}")
    batch, vocab = root_log_probs.shape
    device = root_log_probs.device
    top_k = min(top_k, vocab)

    score, tok = root_log_probs.topk(top_k, dim=-1)  # [B, k]
    cand_tokens, cand_scores = [tok], [score]
    cand_parents, cand_depths = [torch.full_like(tok, -1)], [torch.ones_like(tok)]
    n_cand = top_k
    frontier_ids = torch.arange(top_k, device=device).expand(batch, top_k)  # candidate ids of the frontier
    frontier_tokens, frontier_scores = tok, score
    fed_anc = torch.zeros(batch, 0, 0, dtype=torch.bool, device=device)  # ancestor-or-self among fed nodes
    parent_fed = torch.full((batch, top_k), -1, dtype=torch.long, device=device)  # parent's index among fed nodes
    parent_local = None

    for d in range(2, depth + 1):
        n_fed = fed_anc.shape[1]
        eye = torch.eye(top_k, dtype=torch.bool, device=device).expand(batch, top_k, top_k)
        if n_fed:
            inherited = fed_anc.gather(1, parent_fed.clamp(min=0)[:, :, None].expand(batch, top_k, n_fed))
            inherited = inherited & (parent_fed >= 0)[:, :, None]
        else:
            inherited = torch.zeros(batch, top_k, 0, dtype=torch.bool, device=device)
        new_rows = torch.cat([inherited, eye], dim=2)  # [B, k, n_fed + k]
        fed_anc = torch.cat([torch.cat([fed_anc, fed_anc.new_zeros(batch, n_fed, top_k)], dim=2), new_rows], dim=1)
        lp = expand(frontier_tokens, parent_local, new_rows, d)  # [B, k, V]
        child_lp, child_tok = lp.topk(top_k, dim=-1)  # [B, k, k]
        cum = (frontier_scores[:, :, None] + child_lp).reshape(batch, top_k * top_k)
        cand_tokens.append(child_tok.reshape(batch, -1))
        cand_scores.append(cum)
        cand_parents.append(frontier_ids[:, :, None].expand(batch, top_k, top_k).reshape(batch, -1))
        cand_depths.append(torch.full_like(cum, d, dtype=torch.long))
        _, pick = cum.topk(top_k, dim=-1)  # [B, k] indices into k * k: the next frontier
        parent_local = torch.div(pick, top_k, rounding_mode="floor")
        frontier_tokens = child_tok.reshape(batch, -1).gather(1, pick)
        frontier_scores = cum.gather(1, pick)
        frontier_ids = n_cand + pick
        parent_fed = n_fed + parent_local
        n_cand += top_k * top_k

    tokens, scores = torch.cat(cand_tokens, 1), torch.cat(cand_scores, 1)
    parents, depths = torch.cat(cand_parents, 1), torch.cat(cand_depths, 1)
    n_keep = min(total, tokens.shape[1])
    # candidates are stored depth by depth (parents first), so a stable sort on -score breaks ties shallower-first
    order = torch.sort(-scores, dim=1, stable=True).indices[:, :n_keep]
    keep = order.sort(dim=1).values  # topological order
    new_index = torch.full_like(tokens, -1)
    new_index.scatter_(1, keep, torch.arange(n_keep, device=device).expand(batch, n_keep))
    kept_parents = parents.gather(1, keep)
    remapped = torch.where(kept_parents >= 0, new_index.gather(1, kept_parents.clamp(min=0)), kept_parents)
    # cannot happen unless scores are NaN; checked where a read is free (a NaN target is caught once per call anyway)
    if (host_checks_enabled(device) and not torch.compiler.is_compiling()
            and bool(((kept_parents >= 0) & (remapped < 0)).any())):  # fmt: skip
        raise RuntimeError("draft tree selection is not ancestor-closed (NaN draft scores?)")
    return DraftTree(tokens.gather(1, keep), remapped, depths.gather(1, keep), scores.gather(1, keep))
