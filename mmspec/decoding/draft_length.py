"""The draft-length policy interface: how many tokens each row drafts next round (`draft_length=` in the registry).

A chain drafter (the draft model, the EAGLE chain) asks its policy for every row's K before drafting and tells it
what each row accepted after verifying; the policy lives inside the drafter, so the loop is unchanged:

    k = policy.lengths()                      # [B] K per row for this round (None: every row drafts `k_max`)
    width = policy.host_max                   # the widest row's K, known on the host: the chain's padded length
    ... draft `width` tokens, row r keeps its first min(k[r], remaining) (the verifier's `num_draft`) ...
    policy.update(num_draft, num_accepted, finished)   # the round just verified, per row

Rows draft different lengths in one batch: the chain is padded to the widest row and each row's `num_draft` masks
the rest (`mmspec.verify.chain`: a draft past `num_draft` is never accepted, the row's bonus / residual comes from
its own last position), so a row pays for another's longer draft only the padding of the batched forwards. Drafting
is independent of the target's law: a policy only decides how much is proposed (it reads the draft's own
probabilities and what was accepted), never how it is accepted, so every policy is lossless
(`tests/drafters/test_draft_length.py`).

Host reads: the widest K changes with the rows' acceptance, which lives on the device. A policy that adapts hands
its next width to the loop's one read per round (`sync_value` / `sync_host`, as a target's cache span rides on it),
so adapting costs no read of its own. `update` computes it over the rows that are still running.

The implementations (`mmspec.drafters.lengths`, one file each) are `"fixed"` (K = `k_max` every round, today's
drafting), `"heuristic"` (transformers' schedule), `"confidence"` (stop a row's chain after an unsure draft token)
and `"cost"` (the per-row K that maximises expected tokens per unit of cost).
"""

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


__all__ = ["DraftLength", "RowLengths"]


@runtime_checkable
class DraftLength(Protocol):
    """Sets each row's draft length for the next round, within `[1, k_max]`.

    Attributes:
        name: the registry's name (`mmspec.methods.DRAFT_LENGTHS`).
        k_max: the longest chain a row drafts (`num_draft_tokens` / `tree_depth`): the drafter's scratch width.
        confidence: optional in (0, 1): within a round a row also stops after a draft token the drafter gave a raw
            probability below this (transformers' `assistant_confidence_threshold`); None: no stop.
        host_max: the widest row's K this round, on the host.
    """

    name: str
    k_max: int
    confidence: float | None
    host_max: int

    def start(self, batch: int, device) -> None:
        """A new call: `batch` rows, each at the policy's starting K."""

    def lengths(self) -> Tensor | None:
        """`[B]` each row's K for this round (long, in `[1, k_max]`), or None: every row drafts `k_max`."""

    def update(self, num_draft: Tensor, num_accepted: Tensor, finished: Tensor) -> None:
        """After a verification: row r proposed `num_draft[r]` drafts and `num_accepted[r]` of them were accepted;
        `finished [B]` rows are done (left out of the next width)."""

    def select_rows(self, index: Tensor) -> None:
        """Keep rows `index` (finished rows leave the batch)."""

    def sync_value(self) -> Tensor | None:
        """The next width as a device scalar, read with the loop's one read per round; None: nothing to read."""

    def sync_host(self, value: int) -> None:
        """The loop's read of `sync_value`."""


class RowLengths:
    """Per-row state every adaptive policy shares: `k [B]` (device, long), its host-known maximum over the running
    rows (`host_max`, refreshed from the loop's read), compaction. Subclasses set `name`, `first_k()` (the starting
    K of every row, a host int) and `next_k(num_draft, num_accepted) -> [B]`; one with more per-row state extends
    `start` and `select_rows`."""

    name = ""
    confidence = None

    def __init__(self, k_max: int):
        if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 1:
            raise ValueError(f"k_max must be an int >= 1, got {k_max!r}")
        self.k_max = k_max
        self.k = None
        self.host_max = k_max
        self._width = None

    def first_k(self) -> int:
        return self.k_max

    def next_k(self, num_draft: Tensor, num_accepted: Tensor) -> Tensor:
        raise NotImplementedError

    def start(self, batch, device):
        self.host_max = min(max(1, int(self.first_k())), self.k_max)
        self.k = torch.full((batch,), self.host_max, dtype=torch.long, device=device)
        self._width = None

    def lengths(self):
        return self.k

    def update(self, num_draft, num_accepted, finished):
        self.k = self.next_k(num_draft, num_accepted).clamp(1, self.k_max)
        self._width = torch.where(finished, 0, self.k).max()  # 0 when every row finished (the loop stops)

    def select_rows(self, index):
        self.k = self.k[index]

    def sync_value(self):
        return self._width

    def sync_host(self, value):
        self.host_max = max(1, int(value))
