"""The decoding loop shared by every pipeline: draft -> score -> verify -> commit -> emit, until every row is done.

    while rows remain:
        drop finished rows (state, target cache, drafter state)           # one host sync per round
        proposal = drafter.propose(state)                                 # chain or tree after each pending token
        out = target.forward([pending, drafts] or [pending] + tree)       # p_target of every scored token
        result = verify(rule, proposal, out.p_target)                     # mmspec.verify: exact / LANTERN / GSD ...
        target.commit(accepted prefix);  state.emit(result.tokens)        # ragged: each row its own length
        drafter.commit(result, out, state)

Plain AR decoding is the same loop without a drafter (an empty proposal: the verifier samples one token from
`p_target` per round). Speculative and plain decoding therefore share every line but the draft.

With `enable_compile(verify=True)` a round's verification (a chain's, a Jacobi window's, a tree's; plain AR's draw)
and its emit run as one captured graph (`mmspec.decoding.captured_verify`, on uniforms drawn eagerly first or made by
Philox in the graph). An eager call with a per-row generator list runs the same round uncompiled, so that every row
draws a fixed count a round and no draw reads per-row counts; otherwise `verify_proposal` and `state.emit`.

The only host syncs per round are the compaction check (how many rows remain, how many tokens were generated, for
the progress bar) and those a rule needs inside `mmspec.verify` (tree loop bounds); the per-phase timers (a CUDA
sync around each phase) run only when asked for (`SpecStats(time_phases=True)`). Counters stay on the device
(`SpecStats.record_round`); non-finite distributions are flagged on the device and raised once at the end
(`Guidance.check`).
"""

import logging

import torch

from mmspec.cache import prepend_root
from mmspec.decoding.captured_verify import CapturedVerify
from mmspec.decoding.drafter import Proposal
from mmspec.random import num_rows
from mmspec.sampling import sample
from mmspec.verify import VerifyResult, verify_chain, verify_jacobi, verify_tree
from mmspec.verify.chain import closes_with_bonus
from mmspec.verify.jacobi_tree import verify_jacobi_tree


logger = logging.getLogger(__name__)

__all__ = ["decode", "verify_proposal"]


def verify_proposal(rule, proposal: Proposal, p_target, generator, greedy: bool):
    """Verify one round's `proposal` against `p_target [B, 1 + K, V]` (index 0 = after the pending token) with the
    acceptance `rule` (`mmspec.verify.AcceptanceRule`): tree, Jacobi window (verification + re-draft) or chain. An
    empty proposal (plain AR) samples the next token from `p_target` directly: the same draw `verify_chain` would make
    with no drafts (one uniform per row), without its bookkeeping."""
    if proposal.width == 0 and proposal.parents is None and proposal.jacobi_coupling is None:
        batch = p_target.shape[0]
        # greedy: p_target is one-hot, its argmax is the token (no float64 CDF over the vocabulary per step)
        token = p_target[:, 0].argmax(-1) if greedy else sample(p_target[:, 0], generator)
        none = torch.zeros(batch, dtype=torch.long, device=p_target.device)
        return VerifyResult(num_accepted=none, accept_mask=proposal.tokens.bool(), tokens=token[:, None])
    if proposal.parents is not None and proposal.jacobi_coupling is not None:  # SJD-PAC: Jacobi tree + re-draft
        return verify_jacobi_tree(proposal.tokens, proposal.parents, p_target, proposal.q_draft, rule=rule,
                                  generator=generator, coupling=proposal.jacobi_coupling, validate=False,
                                  layout=proposal.layout)  # fmt: skip
    if proposal.parents is not None:
        return verify_tree(proposal.tokens, proposal.parents, p_target, proposal.q_draft, rule=rule,
                           mode="deterministic", generator=generator, greedy=greedy, validate=False,
                           bounds=proposal.bounds)  # fmt: skip
    if proposal.jacobi_coupling is not None:
        return verify_jacobi(proposal.tokens, p_target, proposal.q_draft, rule=rule, generator=generator,
                             coupling=proposal.jacobi_coupling, num_draft=proposal.num_draft, validate=False)  # fmt: skip
    return verify_chain(rule, proposal.tokens, p_target, proposal.q_draft, generator=generator,
                        num_draft=proposal.num_draft, greedy=greedy, validate=False)  # fmt: skip


def _captured_verify(target, drafter, state):
    """The call's `CapturedVerify`: captured when the target's compiler captures verification
    (`enable_compile(verify=True)`); eager with a per-row generator list (each row draws the round's fixed count of
    uniforms from its own generator, so no draw reads per-row counts: `mmspec.random`); else None."""
    compiler = getattr(target, "compiler", None)
    if compiler is None or not compiler.verify:
        if num_rows(state.generator) is None:
            return None
        compiler = None
    width = 0 if drafter is None else drafter.max_width
    return CapturedVerify(compiler, state.batch_size, width, state.tokens.device)


def _closes_with_bonus(result, proposal, parents, tokens):
    """`[B]`: the round's last token was drawn from `p_target` itself -- every draft of the chain accepted, or the
    accepted tree path ended at a leaf (`parents` / `tokens`: the verification tree, root first; -1 tokens are
    absent nodes) -- rather than from a residual."""
    if parents is None:
        return closes_with_bonus(result.num_accepted, proposal.num_draft, proposal.tokens.shape[1])
    last = result.path.gather(1, result.num_accepted[:, None])  # [B, 1] the last accepted node (root = 0)
    return ~((parents == last) & (tokens >= 0)).any(1)


def _drop_finished(state, target, drafter):
    """Compact finished rows out of the state, the target and the drafter. Returns (rows left, tokens generated
    over the call) and sets `state.max_remaining` -- the loop's one host sync per round."""
    active = ~state.finished
    remaining = torch.where(active, state.remaining(), 0).max()
    values = [active.sum(), state.total_generated(), remaining]
    # a target or drafter that keeps host-side bookkeeping (`sync_value` / `sync_host`) rides on the same read: a
    # device scalar (handed back as an int) or a 1-D tensor of several (handed back as a list)
    syncers = []
    for part in (target, drafter):
        value = getattr(part, "sync_value", lambda: None)()
        if value is not None:
            syncers.append((part, value.dim(), value.numel()))
            values.append(value.to(values[0].dtype))
    # per-row generators are reindexed on the host: the active flags ride on the same read
    per_row = isinstance(state.generator, (list, tuple))
    read = torch.cat([v.reshape(-1) for v in values] + ([active.to(values[0].dtype)] if per_row else []))
    read = read.tolist()
    width = 3 + sum(n for _, _, n in syncers)
    flags = read[width:]
    left, generated, state.max_remaining = read[:3]
    synced, at = [], 3
    for _, dim, n in syncers:
        synced.append(read[at] if dim == 0 else read[at : at + n])
        at += n
    if 0 < left < state.batch_size:
        # the surviving rows in order, without a second read: `left` is known on the host, and a stable sort puts
        # the active rows (key 0) first in their original order
        index = torch.sort((~active).to(torch.uint8), stable=True).indices[:left]
        state.keep(index, [i for i, on in enumerate(flags) if on] if per_row else None)
        target.select_rows(index)
        if drafter is not None:
            drafter.select_rows(index)
    for (part, _, _), value in zip(syncers, synced, strict=True):
        part.sync_host(value)
    return left, generated


def decode(target, drafter, rule, state, guidance, stats, *, progress=None, callback=None):
    """Run rounds until every row of `state` is finished.

    Args:
        target: a `mmspec.decoding.target.Target` whose prefill already ran (each row's first token is pending).
        drafter: a `mmspec.decoding.drafter.Drafter` (prefilled), or None for plain AR decoding.
        rule: the `mmspec.verify` acceptance rule object (`Exact()`, `Lantern(...)`, `Grouped(...)`).
        state: the `SequenceState` (tokens, per-row generators, trace).
        guidance: the call's `Guidance` (greedy flag; finite-probability flags checked at the end).
        stats: `SpecStats` to fill (`target_forwards`, per-round counters; draft / verify time if `time_phases`).
        progress: optional tqdm-like bar (`update(n)`), in tokens.
        callback: optional `fn(state, round_index)` after every round.
    """
    device = state.tokens.device
    reported = 0
    captured = _captured_verify(target, drafter, state)
    while True:
        left, generated = _drop_finished(state, target, drafter)
        if progress is not None:
            progress.update(generated - reported)
            reported = generated
        if not left:
            break
        with stats.phase("draft", device):
            proposal = drafter.propose(state) if drafter is not None else Proposal.empty(state.batch_size, device)
        with stats.phase("verify", device):
            if proposal.parents is None:  # chain [pending, d_1 .. d_K]
                tokens, parents = torch.cat([state.pending[:, None], proposal.tokens], dim=1), None
            else:  # tree [pending (root), nodes]
                tokens, parents = prepend_root(state.pending, proposal.tokens, proposal.parents)
            # absent tree nodes (-1: ragged trees) are scored as token 0 and never used
            out = target.forward(
                tokens.clamp(min=0), parents, return_hidden=drafter is not None and drafter.needs_hidden
            )
            stats.target_forwards += 1
            num = None
            if captured is not None and captured.covers(proposal):  # verifies and emits in one graph
                result, num, accepted = captured(rule, proposal, out.p_target, state, guidance.greedy)
            else:
                result = verify_proposal(rule, proposal, out.p_target, state.generator, guidance.greedy)
        target.commit(result.num_emitted, None if parents is None else result.path.clamp(min=0))
        if num is None:
            num = state.emit(result.tokens, result.num_emitted, _closes_with_bonus(result, proposal, parents, tokens))
            accepted = torch.minimum(result.num_accepted, num)
        if drafter is not None:
            with stats.phase("draft", device):
                drafter.commit(result, out, state)
        stats.record_round(proposal.num_draft, accepted, num, rows=state.ids)
        if callback is not None:
            callback(state, state.rounds)
    guidance.check()
