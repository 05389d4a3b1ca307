"""Captured verification: a chain's, a Jacobi window's or a tree's round (SJD-PAC's included), its verification and the
emit that goes with it, as one
`torch.compile(fullgraph=True, dynamic=False)` graph (`pipe.enable_compile(verify=True)`, `docs/pipelines.md`,
"Captured forwards").

A `torch.Generator` (or a per-row list of them, `mmspec.random`) cannot be traced, so the round's randomness is
drawn eagerly first (`mmspec.decoding.graph_uniforms.GraphUniforms`, shared with captured drafting), in one draw of a
fixed shape: ``uniforms [rows, W + 1]`` (float64) per round, a single
generator's one `rand`, or ``W + 1`` uniforms from each row's own generator (a row's draws depend on its generator
only, and every row draws the same amount each round whatever the rest of the batch does: no per-row counts, no
host read). The rule then runs as a pure tensor function of (drafts, ``p_target``, ``q_draft``, lengths, uniforms),
`mmspec.verify.chain.chain_from_uniforms`: coins ``uniforms[:, :W]``, the residual / bonus token by inverse CDF at
``uniforms[:, W]``. That is the law of `mmspec.verify.verify_chain`, with another random stream than eager's
(greedy decoding draws nothing and gives eager's tokens). The same graph appends the round's tokens to the
`SequenceState`'s buffer (`mmspec.decoding.state.append_tokens`, out of place: the graph takes the buffer, the counts
and the EOS flags and hands back new ones; the round's log stays on the host, `SequenceState.log_round`) and gives
the stats their per-row counts. The cache commit, the loop's compaction read and the stats' log stay eager.

With `enable_compile(verify=True, rng="philox")` the uniforms are made inside the graph instead
(`mmspec.philox.philox_uniforms`): each row of the call gets one Philox key from its generator (a per-row list: from
its own) at the call's first sampled round, and round ``t`` reads the blocks ``(t, j)`` under its row's key. Nothing is
drawn outside the graph (a per-row list cost one launch per row per round), rows in lockstep read the same counters
whatever else is in their batch (batch independence), and the same generators give the same tokens.

Shapes are the call's buckets, so a whole generation compiles one graph per (row bucket, greedy): the width ``W`` is
the drafter's `max_width` every round (0 for plain AR decoding: one token from ``p_target[:, 0]``), a narrower
proposal padded (its padding is never valid); the rows are `row_bucket`s of the call's first batch, as the
forwards'. Padding rows verify (and append to) copies of row 0 and are cut off.

Covered: chain proposals under any `mmspec.verify.AcceptanceRule` (exact, LANTERN, GSD), sampled or greedy; plain AR
decoding; and Jacobi windows (SJD, SCD, and LANTERN / GSD on Jacobi drafts): the verification, SJD's or SCD's
re-draft and the next window as `mmspec.verify.jacobi.jacobi_from_uniforms` on ``3 W + 2`` uniforms per row (coins,
the next token, the fresh re-drafts, the coupled residual re-drafts; `mmspec.verify.jacobi.jacobi_uniforms`), the
window handed back to the drafter as a `JacobiResult`; and trees with deterministic children and host bounds
(EAGLE-2 trees of an EAGLE head or a draft LM: `mmspec.verify.tree.tree_from_uniforms` on the bounds' grid of coins +
1 uniform per row, the tree padded with absent nodes, the path cut to the bounds' depth); and SJD-PAC's Jacobi tree
at its full host layout (`mmspec.verify.jacobi_tree.verify_jacobi_tree` with `jacobi_tree_uniforms` per row: the
tree part's grid of coins, its chain tail's, the main branch's coupled re-draft; the captured proposal keeps its whole window up to the image's end, so
a tree cut short -- only an eager proposal's -- verifies eagerly, `mmspec.decoding.loop.verify_proposal`, as does
everything when verification capture is off, the default).
"""

import torch

from mmspec.decoding.compiled import pad_rows, row_bucket
from mmspec.decoding.drafter import Proposal
from mmspec.decoding.graph_uniforms import GraphUniforms, resolve_uniforms
from mmspec.decoding.state import append_tokens
from mmspec.methods import COMPILE_RNG
from mmspec.verify import JacobiResult, VerifyResult
from mmspec.verify.chain import chain_from_uniforms, closes_with_bonus
from mmspec.verify.jacobi import jacobi_from_uniforms, jacobi_uniforms
from mmspec.verify.jacobi_tree import jacobi_tree_uniforms, verify_jacobi_tree
from mmspec.verify.tree import tree_from_uniforms, tree_uniforms


__all__ = ["CapturedVerify", "captured_round"]


def captured_round(rule, draft_tokens, p_target, q_draft, num_draft, uniforms, buffer, count, ended, max_length, eos,
                   keys=None, round_index=None, jacobi=None, tree_parents=None, bounds=None, layout=None):  # fmt: skip
    """The traced function: `chain_from_uniforms` (or, with `jacobi` a bool, `jacobi_from_uniforms` with that
    coupling; with `tree_parents [B, N]`, `mmspec.verify.tree.tree_from_uniforms` within the host `bounds`, or with a
    host `layout` too, SJD-PAC's `mmspec.verify.jacobi_tree.verify_jacobi_tree`), then the round's tokens appended to the state's buffer (`mmspec.decoding.state.append_tokens`, out of
    place). `draft_tokens` / `num_draft` None: no drafts (plain AR decoding). `keys [rows, 2]` / `round_index` (0-d):
    the uniforms are Philox blocks made here instead of `uniforms` (`mmspec.philox.philox_uniforms`). Returns
    (num_accepted, accept_mask, tokens, accept_prob, num_emitted, buffer, count, ended, num, bonus, accepted), then
    for a Jacobi window (next_drafts, next_q, num_carried): `bonus` the round closed with a token drawn from
    `p_target` itself (every valid draft accepted), `accepted` the accepted drafts kept (`min(num_accepted, num)`,
    for the stats)."""
    if draft_tokens is None:
        draft_tokens = torch.zeros(p_target.shape[0], 0, dtype=torch.long, device=p_target.device)
    width = draft_tokens.shape[1]
    uniforms = resolve_uniforms(uniforms, keys, round_index, uniform_count(width, jacobi, bounds, layout))
    if layout is not None:
        out = verify_jacobi_tree(draft_tokens, tree_parents[0], p_target, q_draft, generator=None, coupling=jacobi,
                                 rule=rule, validate=False, layout=list(layout), uniforms=uniforms)  # fmt: skip
    elif tree_parents is not None:
        out = tree_from_uniforms(rule, draft_tokens, tree_parents, p_target, bounds, uniforms)
    elif jacobi is None:
        out = chain_from_uniforms(rule, draft_tokens, p_target, q_draft, num_draft, uniforms)
    else:
        out = jacobi_from_uniforms(rule, draft_tokens, p_target, q_draft, num_draft, uniforms, jacobi)
    buffer, count, ended, num = append_tokens(buffer, count, ended, out.tokens, out.num_emitted, max_length, eos)
    if tree_parents is None:
        bonus = closes_with_bonus(out.num_accepted, num_draft, width)
    else:  # the accepted path ended at a node with no present child: its token came from p_target itself
        last = out.path.gather(1, out.num_accepted[:, None])  # [B, 1] p_target row (0 = root, 1 + node)
        bonus = ~(((tree_parents + 1) == last) & (draft_tokens >= 0)).any(1)
    accepted = torch.minimum(out.num_accepted, num)
    verified = (out.num_accepted, out.accept_mask, out.tokens, out.accept_prob, out.num_emitted)
    extra = (out.path,) if tree_parents is not None else ()
    if jacobi is not None:
        extra = (*extra, out.next_drafts, out.next_q, out.num_carried)
    return (*verified, buffer, count, ended, num, bonus, accepted, *extra)


def uniform_count(width: int, jacobi=None, bounds=None, layout=None) -> int:
    """Uniforms per row of a captured round: a chain's ``W + 1``, a Jacobi window's ``3 W + 2``, a tree's grid of
    coins + 1, a Jacobi tree's `jacobi_tree_uniforms`."""
    if layout is not None:
        return jacobi_tree_uniforms(layout)
    if bounds is not None:
        return tree_uniforms(bounds)
    return width + 1 if jacobi is None else jacobi_uniforms(width)


def _pad_width(x, width, value=0):
    """`x [B, K, ...]` padded with `value` (zeros) to `width` columns (one op; never valid, never read as a
    distribution); None stays None."""
    if x is None or x.shape[1] >= width:
        return x
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, width - x.shape[1]), value=value)


class CapturedVerify:
    """One decoding call's captured chain verification (`mmspec.decoding.loop.decode` makes it when the target's
    compiler has `verify` on), or the same round run eagerly (`compiler` None: what an eager call with a per-row
    generator list verifies through, so that each row draws a fixed amount a round and nothing reads per-row counts).

    Args:
        compiler: the pipeline's `mmspec.decoding.compiled.Compiler` (role ``"verify"``; its graphs are kept across
            calls), or None: `captured_round` runs eagerly on the live rows (no row buckets), its uniforms drawn
            from the rows' generators (``"generator"``).
        rows: the call's batch items (the row buckets' limit).
        width: the drafter's `max_width` (0: plain AR decoding).
        device: where the call runs.
    """

    def __init__(self, compiler, rows: int, width: int, device):
        self.compiler, self.rows, self.width, self.device = compiler, int(rows), int(width), torch.device(device)
        self.random = GraphUniforms(getattr(compiler, "rng", COMPILE_RNG), rows, device)

    def covers(self, proposal: Proposal) -> bool:
        """A chain, a Jacobi window (SJD / SCD / GSD on Jacobi drafts), a tree with deterministic children and host
        bounds, SJD-PAC's Jacobi tree at its full layout, or an empty proposal, no wider than the call's width: the
        rounds this object verifies (the rest verify eagerly)."""
        if proposal.width > self.width:
            return False
        if proposal.parents is not None and proposal.jacobi_coupling is not None:  # SJD-PAC: its full host layout
            return proposal.layout is not None and proposal.q_draft is not None and proposal.width == self.width
        if proposal.parents is not None:  # EAGLE-2 / draft-LM trees: deterministic children within host bounds
            return proposal.q_draft is None and proposal.bounds is not None
        return proposal.jacobi_coupling is None or proposal.q_draft is not None

    def __call__(self, rule, proposal: Proposal, p_target, state, greedy: bool):
        """Verify one round (as `mmspec.decoding.loop.verify_proposal`) and append its tokens to `state` (as
        `SequenceState.emit`) through the captured graph. Returns ``(VerifyResult, num [B'], accepted [B'])``: the
        tokens appended per row and the accepted drafts among them."""
        live, k = proposal.tokens.shape
        rows, width = live if self.compiler is None else row_bucket(live, self.rows), self.width
        jacobi = proposal.jacobi_coupling
        greedy = greedy and jacobi is None  # a Jacobi window always draws (as eager: its greedy p is one-hot)
        tree = proposal.parents is not None
        layout = tuple(int(x) for x in proposal.layout) if tree and jacobi is not None else None
        bounds = tuple(int(b) for b in proposal.bounds) if tree and layout is None else None
        tokens, lengths = None, None  # plain AR decoding: no drafts (made in the graph)
        if width:
            # a tree's padding nodes are absent (-1) children of the root; a chain's are past its length
            tokens = pad_rows(_pad_width(proposal.tokens, width, -1 if tree else 0), rows)
            lengths = pad_rows(proposal.num_draft, rows, fill=0)
        p = pad_rows(_pad_width(p_target, width + 1), rows)
        q = pad_rows(_pad_width(proposal.q_draft, width), rows)
        uniforms = keys = round_index = None
        if not greedy:
            uniforms, keys, round_index = self.random.inputs(state, rows, uniform_count(width, jacobi, bounds, layout))
        state.reserve(width + 1)
        held = [pad_rows(x, rows) for x in (state.tokens, state.count, state.ended)]
        if self.compiler is None:  # eager
            run = captured_round
        else:
            run = self.compiler.forward("verify", captured_round, device=self.device)  # made on first use, then kept
        window = {} if jacobi is None else {"jacobi": bool(jacobi)}
        if tree:
            parents = proposal.parents  # [K], [1, K] or [B, K]
            parents = parents if parents.shape[0] == live and parents.ndim == 2 else parents.expand(live, k)
            window = {**window, "tree_parents": pad_rows(_pad_width(parents, width, -1), rows), "bounds": bounds}
            if layout is not None:
                window["layout"] = layout
        if keys is None:
            out = run(rule, tokens, p, q, lengths, uniforms, *held, state.max_length, state.eos, **window)
        else:
            out = run(rule, tokens, p, q, lengths, None, *held, state.max_length, state.eos, keys, round_index,
                      **window)  # fmt: skip
        if rows > live:
            out = [x[:live] for x in out]
        verified, window = out[:11], out[11:]
        num_accepted, accept_mask, chosen, accept_prob, num_emitted, buffer, count, ended, num, bonus, accepted = (
            verified
        )
        if width > k:
            accept_mask, accept_prob = accept_mask[:, :k], accept_prob[:, :k]
            chosen = chosen if tree else chosen[:, : k + 1]
        state.tokens, state.ended = buffer, ended
        widest = chosen.shape[1] if layout is not None else min(bounds[0], k) + 1 if tree else k + 1
        state.log_round(widest, count, num, num_accepted, bonus)
        verified = (num_accepted, accept_mask, chosen)
        if layout is not None:  # SJD-PAC: the path, then the main branch's carried window (never padded)
            path, next_drafts, next_q, num_carried = window
            result = JacobiResult(*verified, path=path, accept_prob=accept_prob, num_emitted=num_emitted,
                                  next_drafts=next_drafts, next_q=next_q, num_carried=num_carried)  # fmt: skip
        elif tree:  # the path and its tokens as deep as the proposal's tree can be (the bounds', as eager off the CPU)
            (path,) = window
            depth = min(bounds[0], k) + 1
            chosen, path = chosen[:, :depth], path[:, :depth]
            result = VerifyResult(num_accepted, accept_mask, chosen, path=path, accept_prob=accept_prob,
                                  num_emitted=num_emitted)  # fmt: skip
        elif jacobi is None:
            result = VerifyResult(*verified, accept_prob=accept_prob, num_emitted=num_emitted)
        else:  # the carried drafts sit in the first k - n columns: the window the drafter keeps is k wide, as eager's
            next_drafts, next_q, num_carried = window
            if width > k:
                next_drafts, next_q = next_drafts[:, :k], next_q[:, :k]
            result = JacobiResult(*verified, accept_prob=accept_prob, num_emitted=num_emitted,
                                  next_drafts=next_drafts, next_q=next_q, num_carried=num_carried)  # fmt: skip
        return result, num, accepted
