"""SJD-PAC proactive drafting: the Jacobi window proposed as a shallow wide tree plus a chain (no extra forward).

Paper: SJD-PAC (Kang et al., CVPR 2026, arXiv 2603.18599). Notation: ``p_target`` = the target's processed
distribution, ``q_draft`` = the law a draft was drawn from.

The window ``d_1 .. d_L`` with laws ``q_1 .. q_L`` is kept exactly as `JacobiDrafter` keeps it (carried re-drafts,
then fresh ``repeat`` / ``random`` tokens with a point-mass law). Each round it is proposed as a tree rooted at the
pending token (the token resampled after the last rejection) of ``depth`` levels counting the root: window
positions ``1 .. depth-1`` branch ``width`` ways, positions ``depth .. L`` continue as one chain under the main
branch. Children of a main node: the carried main draft ``d_j`` first, then ``width - 1`` tokens drawn without
replacement from ``q_j`` with ``d_j`` removed; children of a side node: ``width`` tokens drawn without replacement
from ``q_j``. So every sibling set is one sequential without-replacement draw from ``q_j`` (main draft first), the
law `mmspec.verify.verify_jacobi_tree` verifies with. At a fresh position (point-mass ``q_j``) the side siblings are
drawn from the last carried position's ``q`` instead (neighbouring image tokens look alike) and their ``q_draft``
says so; with nothing carried a fresh position has one child. Nodes past a row's last position, and the children of absent nodes, are absent (-1). The draws use the cached ``q_j`` only: no
forward. Nodes are in breadth-first order (level by level, each parent's children contiguous, main first).

Adaptive continuation (the main branch's coupled re-draft) happens inside verification (`verify_jacobi_tree`).
"""

import torch

from mmspec.decoding.captured_draft import CapturedDraft, captures_rounds
from mmspec.decoding.drafter import Proposal
from mmspec.decoding.graph_uniforms import resolve_uniforms
from mmspec.drafters.jacobi import JacobiDrafter, fill_window
from mmspec.methods import KNOBS, MethodSettings, check_knobs
from mmspec.random import num_rows, rand


__all__ = [
    "ProactiveJacobiDrafter",
    "make_jacobi_drafter",
    "proactive_nodes",
    "proactive_round",
    "side_laws",
    "tree_layout",
]


def tree_layout(width: int, depth: int, window: int) -> tuple[list[int], list[int], list[int]]:
    """The node layout for ``window`` positions: ``(parents, position, level_start)`` as host lists.

    ``parents[i]`` (-1 = child of the pending token), ``position[i]`` (window position, 1-based) of node i;
    ``level_start[j]`` = index of the first node of position ``j+1`` (its main node), for every position.
    """
    parents, position, level_start = [], [], []
    prev = [-1]  # the nodes of the previous level, main first
    for j in range(1, window + 1):
        level_start.append(len(parents))
        kids = width if j < depth else 1
        level = []
        for par in prev if j < depth else prev[:1]:
            for _ in range(kids):
                level.append(len(parents))
                parents.append(par)
                position.append(j)
        prev = level
    return parents, position, level_start


def _without_replacement(q, count, first, u):
    """``count`` tokens drawn sequentially without replacement from ``q [B, P, V]`` (exponential race on the uniforms
    ``u`` of ``q``'s shape: the order of ``q / E``, ``E = -log(1 - u) ~ Exp(1)``, in ``u``'s dtype); where ``first
    [B, P]`` >= 0 that token is forced to come first. Tokens whose key is 0 (``q = 0``: nothing left to draw) are -1.
    Returns ``[B, P, count]``."""
    keys = q.to(u.dtype) / (-torch.log1p(-u)).clamp_min(torch.finfo(u.dtype).tiny)
    vocab = torch.arange(q.shape[-1], device=q.device)
    keys = torch.where(vocab == first[..., None], torch.inf, keys)
    top, idx = keys.topk(count, dim=-1)
    return torch.where(top > 0, idx, -1)


def side_laws(q, num_carried):
    """``[B, L, V]``: the law the side siblings at each position are drawn from: the window's ``q_j`` where it was
    carried (a real distribution), else -- a fresh token with a point-mass law -- the last carried position's ``q``
    (image tokens look like their neighbours); rows with nothing carried keep ``q_j`` (one child). The verifier gets
    exactly these laws per node (`q_draft`), so any choice stays lossless."""
    window = q.shape[1]
    carried = num_carried.clamp(max=window)
    last = q.gather(1, (carried - 1).clamp(min=0)[:, None, None].expand(-1, 1, q.shape[-1]))  # [B, 1, V]
    fresh = torch.arange(window, device=q.device)[None, :] >= carried[:, None]
    return torch.where((fresh & (carried > 0)[:, None])[..., None], last, q)


def _levels(starts, n, width, depth, window):
    """The branching levels ``(j, lo, hi, parents)``: window positions ``1 .. D-1`` (within the window), their nodes
    ``lo:hi`` and their parents' count (main first)."""
    for j in range(1, min(depth, window + 1)):
        lo, hi = starts[j - 1], (starts[j] if j < window else n)
        yield j, lo, hi, (hi - lo) // width


def proactive_nodes(drafts, q, num_draft, num_carried, parents, position, starts, width, depth, uniforms_of):
    """The proposal's nodes (module docstring) from the window ``drafts [B, L]`` / ``q [B, L, V]`` and the layout
    (`tree_layout`'s parents and positions as tensors, its level starts as a list): ``(tokens [B, n], q_nodes [B, n,
    V])``. ``uniforms_of(j, shape)`` gives the uniforms of level ``j``'s without-replacement draws (every row draws
    every parent's: a fixed count a round, whatever the row uses)."""
    batch, window = drafts.shape
    n, vocab = parents.numel(), q.shape[-1]
    tokens = torch.full((batch, n), -1, dtype=torch.long, device=drafts.device)
    tokens[:, starts] = drafts  # the main branch
    q_side = side_laws(q, num_carried)
    for j, lo, hi, parts in _levels(starts, n, width, depth, window):
        q_j = q_side[:, j - 1, None, :].expand(batch, parts, vocab)
        first = torch.full((batch, parts), -1, dtype=torch.long, device=drafts.device)
        first[:, 0] = drafts[:, j - 1]
        kids = _without_replacement(q_j, width, first, uniforms_of(j, q_j.shape))  # [B, P, W]
        tokens[:, lo:hi] = kids.reshape(batch, parts * width)
    pos = position[None, :]
    tokens = torch.where(pos <= num_draft[:, None], tokens, -1)
    # children of absent side nodes are absent (levels in order: one pass; the chain hangs off main nodes, which are
    # absent only past num_draft)
    par = parents.clamp(min=0)[None].expand(batch, n)
    for j, lo, hi, _ in _levels(starts, n, width, depth, window):
        if j >= 2:
            alive = tokens.gather(1, par[:, lo:hi]) >= 0
            tokens[:, lo:hi] = torch.where(alive, tokens[:, lo:hi], -1)
    index = (position - 1)[None, :, None].expand(batch, n, vocab)
    is_main = torch.zeros(n, dtype=torch.bool, device=drafts.device)
    is_main[starts] = True
    return tokens, torch.where(is_main[None, :, None], q.gather(1, index), q_side.gather(1, index))


def _uniform_offsets(width: int, depth: int, vocab: int) -> list[int]:
    """Where each branching level's uniforms start in a captured proposal's row (entry ``j - 1`` for level ``j``,
    then the end): ``V`` for each of level ``j``'s ``width ** (j - 1)`` parents, the same offsets for any window."""
    offsets = [0]
    for j in range(1, depth):
        offsets.append(offsets[-1] + width ** (j - 1) * vocab)
    return offsets


def proactive_uniforms(width: int, depth: int, window: int, vocab: int) -> int:
    """Uniforms per row of a captured SJD-PAC proposal over a ``window``: those of its branching levels."""
    return _uniform_offsets(width, depth, vocab)[min(depth, window + 1) - 1]


def proactive_round(drafts, q, num_draft, num_carried, parents, position, uniforms, keys, round_index, *, starts,
                    width, depth, n_uniforms, pending=None):  # fmt: skip
    """`proactive_nodes` as a pure function for one captured graph (`mmspec.decoding.captured_draft`): level ``j``'s
    draws read its slice of the round's ``n_uniforms`` uniforms per row (or Philox blocks of `keys`), in float64.
    `pending [B]` given: the window's positions past ``num_carried`` are filled first (`init="repeat"`,
    `mmspec.drafters.jacobi.fill_window`: what the drafter's commit does eagerly otherwise). Returns ``(tokens,
    q_nodes, drafts, q)``, the last two the window proposed."""
    if pending is not None:
        drafts, q = fill_window(drafts, q, num_carried, pending)
    uniforms = resolve_uniforms(uniforms, keys, round_index, n_uniforms)
    offsets = _uniform_offsets(width, depth, q.shape[-1])

    def uniforms_of(j, shape):
        return uniforms[:, offsets[j - 1] : offsets[j]].reshape(shape)

    tokens, q_nodes = proactive_nodes(drafts, q, num_draft, num_carried, parents, position, list(starts), width,
                                      depth, uniforms_of)  # fmt: skip
    return tokens, q_nodes, drafts, q


class ProactiveJacobiDrafter(JacobiDrafter):
    """SJD-PAC drafter (module docstring): the Jacobi window proposed as a ``width``-ary tree of ``depth`` levels
    (the pending token is level 1) plus a chain out to ``window``.

    Args:
        vocab_size: V; window: L, window positions (main-branch drafts) per round; width: W >= 2, children per
            node in the tree part; depth: D >= 2 (``D - 1 <= L`` tree positions); init, coupling: as `JacobiDrafter`.
    """

    def __init__(self, vocab_size, window, width=3, depth=3, init="repeat", coupling=True):
        super().__init__(vocab_size, window, init, coupling)
        # the registry's bounds (`mmspec.methods.check_knobs`: ranges, tree within the window, node count)
        check_knobs(jacobi_window=self.window, jacobi_tree_width=width, jacobi_tree_depth=depth)
        if width < 2:
            raise ValueError(
                f"jacobi_tree_width must be >= 2 for a tree (1 = the SJD chain: JacobiDrafter), got {width}"
            )
        self.width, self.depth = int(width), int(depth)
        self.compiler = None  # with `verify` on, a round's proposal is one graph (`CapturedDraft`, made at prefill)
        self.captured = None
        self.max_width = len(tree_layout(width, depth, self.window)[0])
        self._layouts, self._host_layouts = {}, {}

    def _layout(self, window, device):
        key = (window, device)
        if key not in self._layouts:
            parents, position, starts = tree_layout(self.width, self.depth, window)
            self._host_layouts[window] = list(parents)  # the verifier's host copy (no read of the tensor)
            self._layouts[key] = (
                torch.tensor(parents, dtype=torch.long, device=device),
                torch.tensor(position, dtype=torch.long, device=device),
                starts,
            )
        return self._layouts[key]

    def prefill(self, state, target_out=None):
        super().prefill(state, target_out)
        self.num_carried = torch.zeros(state.batch_size, dtype=torch.long, device=state.tokens.device)
        self.captured = (CapturedDraft(self.compiler, state.batch_size, state.tokens.device)
                         if captures_rounds(self.compiler) else None)  # fmt: skip

    def commit(self, result, target_out, state):
        if self._fills_in_graph:  # the next window's fresh positions are filled in the next proposal's graph
            self.drafts, self.q_draft = result.next_drafts, result.next_q
        else:
            super().commit(result, target_out, state)
        self.num_carried = result.num_carried.clone()

    @property
    def _fills_in_graph(self) -> bool:
        """Captured with `init="repeat"`: the window's fill is part of the proposal's graph (a random fill draws with
        the generators, eagerly at commit)."""
        return self.captured is not None and self.init == "repeat"

    def select_rows(self, index):
        super().select_rows(index)
        self.num_carried = self.num_carried[index]

    def propose(self, state):
        # eager with per-row generators: the whole window too, so a row's sibling draws (the layout's full count,
        # never per-row counts) and its verification's uniforms never depend on the rest of its batch
        if self.captured is None and num_rows(state.generator) is None:
            chain = super().propose(state)  # the window, cut to what any row can use
            drafts, q, num_draft = chain.tokens, chain.q_draft, chain.num_draft
        else:  # the whole window every round (one tree layout: one graph); positions past a row's end are absent
            drafts, q = self.drafts, self.q_draft
            num_draft = state.remaining().clamp(min=1, max=self.window)
        batch, window = drafts.shape
        parents, position, starts = self._layout(window, drafts.device)
        if self.captured is not None:  # one graph (`mmspec.decoding.captured_draft`); a window always draws
            count = proactive_uniforms(self.width, self.depth, self.window, self.vocab_size)
            pending = state.pending if self._fills_in_graph else None
            tokens, q_nodes, self.drafts, self.q_draft = self.captured(
                proactive_round, state, count, drafts, q, num_draft, self.num_carried, parents, position,
                starts=tuple(starts), width=self.width, depth=self.depth, n_uniforms=count, pending=pending)  # fmt: skip
        else:

            def uniforms_of(j, shape):
                # with per-row generators the shape is the whole window's: every row draws all of it
                return rand(shape, state.generator, device=q.device, dtype=q.dtype)

            tokens, q_nodes = proactive_nodes(drafts, q, num_draft, self.num_carried, parents, position, starts,
                                              self.width, self.depth, uniforms_of)  # fmt: skip
        n = parents.numel()
        layout = self._host_layouts[window]
        return Proposal(tokens, num_draft, q_draft=q_nodes, parents=parents[None].expand(batch, n),
                        jacobi_coupling=self.coupling, layout=layout)  # fmt: skip


def make_jacobi_drafter(vocab_size, settings):
    """The Jacobi drafter of a call's method: `JacobiDrafter` (SJD / SCD chain) at `jacobi_tree_width` 1, else
    `ProactiveJacobiDrafter` (SJD-PAC). `settings`: a `mmspec.methods.MethodSettings` (checked and defaulted
    once, read as it is), or a mapping with `jacobi_window`, `jacobi_init`, `coupling` and optionally
    `jacobi_tree_width` / `jacobi_tree_depth` (checked here by the registry, the rest at their defaults)."""
    if not isinstance(settings, MethodSettings):
        names = ("jacobi_window", "jacobi_init", "coupling", "jacobi_tree_width", "jacobi_tree_depth")
        settings = check_knobs(**{name: settings.get(name, KNOBS[name].default) for name in names})
    window, init, coupling = settings["jacobi_window"], settings["jacobi_init"], settings["coupling"]
    width = settings["jacobi_tree_width"]
    if width == 1:
        return JacobiDrafter(vocab_size, window, init, coupling)
    return ProactiveJacobiDrafter(vocab_size, window, width, settings["jacobi_tree_depth"], init, coupling)
