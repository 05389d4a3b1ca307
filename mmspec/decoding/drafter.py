"""The drafter interface: what the decoding loop (`mmspec.decoding.loop`) needs from anything that proposes tokens.

A drafter owns its state (its model's KV cache, EAGLE's pending feature pairs, the Jacobi window) and updates it
from the verification result; the loop never reaches inside it. One round of the loop:

    proposal = drafter.propose(state)                 # drafts after each row's pending token
    out = target.forward(pending + proposal)          # p_target over [pending, drafts] (chain) or the tree
    result = verify(rule, proposal, out.p_target)     # mmspec.verify
    target.commit(...); state.emit(...)
    drafter.commit(result, out, state)                # e.g. roll its cache back to the accepted prefix
    drafter.select_rows(index)                        # when finished rows leave the batch

A new drafter is one file implementing this protocol (plus a registry entry in `mmspec.methods`), not a new loop.
"""

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


__all__ = ["Drafter", "JointSync", "Proposal"]


@dataclass
class Proposal:
    """Draft tokens for one round (batch items `B`, after compaction).

    Attributes:
        tokens: `[B, K]` draft tokens following each row's pending token (chain), or the nodes of a draft tree.
        num_draft: `[B]` valid drafts per row (`<= K`; a row near its end drafts fewer).
        q_draft: `[B, K, V]` the distributions the drafts were drawn from, or None for point-mass drafts (argmax,
            top-k tree children, Jacobi fresh tokens without a distribution).
        parents: `[B, K]` tree parents (topological order, -1 = child of the pending token), None for a chain.
        jacobi_coupling: set by self-drafting (Jacobi) drafters: verification also re-drafts the window from this
            round's `p_target` (`mmspec.verify.verify_jacobi`; True = SCD maximal coupling).
        bounds: for a tree, host-known upper bounds `(depth, children per node)` (e.g. `tree_depth`, `tree_top_k`):
            the verifier's loops then need no host read for their extents on an accelerator.
        layout: for a tree whose shape is the same every row and round (SJD-PAC), `parents[0]` as a host list.
    """

    tokens: Tensor
    num_draft: Tensor
    q_draft: Tensor | None = None
    parents: Tensor | None = None
    jacobi_coupling: bool | None = None
    bounds: tuple[int, int] | None = None
    layout: list[int] | None = None

    @staticmethod
    def empty(batch: int, device=None) -> "Proposal":
        """No drafts (plain AR decoding: the loop then samples one token per round from `p_target`)."""
        return Proposal(
            torch.zeros(batch, 0, dtype=torch.long, device=device), torch.zeros(batch, dtype=torch.long, device=device)
        )

    @property
    def width(self) -> int:
        return self.tokens.shape[1]


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens and keeps its own state in step with what the target committed.

    Attributes:
        needs_hidden: the drafter reads the target's hidden states (`TargetOutput.hidden`) in `prefill`/`commit`.
        max_width: the widest proposal it makes (the target allocates that much cache scratch).
    """

    needs_hidden: bool
    max_width: int

    def prefill(self, state, target_out) -> None:
        """Start: `state` holds each row's first token (pending), `target_out` the prefill's `TargetOutput`."""

    def propose(self, state) -> Proposal:
        """Drafts after each row's pending token (respecting `state.remaining()`)."""

    def commit(self, result, target_out, state) -> None:
        """After verification and `state.emit`: bring the drafter's state to the new committed prefix."""

    def select_rows(self, index: Tensor) -> None:
        """Keep only batch items `index [B']` (finished rows leave)."""


class JointSync:
    """Several parts' host bookkeeping as one drafter's `sync_value` / `sync_host` (a drafter that holds a draft
    adapter and a draft-length policy, each with its own value to read): the loop reads the values that are not None
    as one 1-D tensor with its one read per round and hands them back part by part."""

    def __init__(self, *parts):
        self.parts = parts
        self._read = ()

    def value(self):
        pairs = [(part, getattr(part, "sync_value", lambda: None)()) for part in self.parts]
        pairs = [(part, value) for part, value in pairs if value is not None]
        self._read = tuple(part for part, _ in pairs)
        if not pairs:
            return None
        return torch.stack([value.reshape(()).to(torch.long) for _, value in pairs])

    def host(self, values) -> None:
        for part, value in zip(self._read, values, strict=True):
            part.sync_host(value)
