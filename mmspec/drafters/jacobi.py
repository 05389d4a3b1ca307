"""Jacobi self-drafting (SJD, Teng et al., arXiv 2410.01699): the target drafts for itself.

The draft for window position j is the token the target itself sampled at j in the previous Jacobi iteration
(conditioned on the then-unverified window), with `q_draft` = that iteration's processed distribution. Positions
that have no previous sample get *fresh* initial tokens with a point-mass `q_draft`:

* `init="repeat"` (SJD's `repeat_horizon` for LlamaGen): copy the token before it in raster order, a strong prior
  on images with flat backgrounds (MNIST's black border);
* `init="random"` (SJD's default for Lumina-mGPT): a uniform random token.

Both are fixed before the target looks at the window, so a one-hot `q_draft` is exactly the law they were drawn
with given the context, as the verifier needs. The re-draft of carried positions (independent, or maximally
coupled as in SCD) happens inside verification (`mmspec.verify.verify_jacobi`, asked for by the proposal's
`jacobi_coupling`): it reuses the verification coins. This class only keeps the window.
"""

import torch

from mmspec.decoding.drafter import Proposal
from mmspec.methods import KNOBS, check_knobs
from mmspec.random import num_rows, rand


__all__ = ["JacobiDrafter", "fill_window"]


class JacobiDrafter:
    """Keeps the Jacobi window `[B, K]` of drafts and their `q_draft [B, K, V]` between iterations
    (`mmspec.decoding.drafter.Drafter`).

    Args:
        vocab_size: V.
        window: K, draft tokens per iteration (the verification forward scores `pending + K` tokens).
        init: `"repeat"` or `"random"` (see module docstring).
        coupling: re-draft with SCD maximal coupling (True) or independently as SJD (False).
    """

    INITS = KNOBS["jacobi_init"].kind  # ("repeat", "random")
    needs_hidden = False
    draft_forwards = 0

    def __init__(self, vocab_size, window, init="repeat", coupling=True):
        check_knobs(jacobi_window=window, jacobi_init=init)  # the registry's bounds
        self.vocab_size, self.window, self.init, self.coupling = vocab_size, int(window), init, bool(coupling)
        self.max_width = self.window
        self.drafts = None  # [B, K]
        self.q_draft = None  # [B, K, V]

    def prefill(self, state, target_out=None):
        """Start a fresh window after each row's pending token (all positions freshly initialised)."""
        b, device = state.batch_size, state.tokens.device
        self.drafts = torch.full((b, self.window), -1, dtype=torch.long, device=device)
        self.q_draft = torch.zeros(b, self.window, self.vocab_size, device=device)
        self._fill(state, torch.zeros(b, dtype=torch.long, device=device))

    def propose(self, state):
        num_draft = state.remaining().clamp(min=1, max=self.window)
        width = min(self.window, state.max_remaining)  # near the end: no drafts past the last token of any row
        if width < self.drafts.shape[1]:
            self.drafts, self.q_draft = self.drafts[:, :width], self.q_draft[:, :width]
        return Proposal(self.drafts, num_draft, q_draft=self.q_draft, jacobi_coupling=self.coupling)

    def commit(self, result, target_out, state):
        """Next window from the `JacobiResult`: the carried re-drafts (left-aligned) and fresh tokens after them."""
        self.drafts = result.next_drafts.clone()
        self.q_draft = result.next_q.clone()
        self._fill(state, result.num_carried)

    def select_rows(self, index):
        self.drafts, self.q_draft = self.drafts[index], self.q_draft[index]

    def _fill(self, state, num_carried):
        """Fill positions `>= num_carried [B]` with fresh tokens (point-mass `q_draft`)."""
        tokens = None
        if self.init == "random":
            b, k = self.drafts.shape
            # per-row generators: every row draws the whole window each fill (its draws never depend on its batch)
            width = k if num_rows(state.generator) is None else self.window
            u = rand((b, width), state.generator, device=self.drafts.device)[:, :k]
            tokens = (u * self.vocab_size).long().clamp(max=self.vocab_size - 1)
        self.drafts, self.q_draft = fill_window(self.drafts, self.q_draft, num_carried, state.pending, tokens)


def fill_window(drafts, q_draft, num_carried, pending, tokens=None):
    """The window `drafts [B, K]` / `q_draft [B, K, V]` with positions `>= num_carried [B]` fresh: `tokens [B, K]`
    there (`init="random"`), or, None, `init="repeat"`: a copy of the last known token before the fresh run (the
    last carried draft, else the row's `pending` token); each with a point-mass law. A pure tensor function (also
    inside SJD-PAC's captured proposal, `mmspec.drafters.jacobi_pac.proactive_round`)."""
    b, k = drafts.shape
    fresh = torch.arange(k, device=drafts.device)[None, :] >= num_carried[:, None]  # [B, K]
    if tokens is None:  # repeat: every fresh slot copies the last known token before the fresh run
        last_idx = (num_carried - 1).clamp(min=0)
        last_known = torch.where(num_carried > 0, drafts.gather(1, last_idx[:, None])[:, 0], pending)
        tokens = last_known[:, None].expand(b, k)
    drafts = torch.where(fresh, tokens, drafts)
    # point masses at the fresh drafts, written in place of q (no int64 [B, K, V] one-hot: half the memory)
    point = torch.zeros_like(q_draft).scatter_(2, drafts.clamp(min=0)[..., None], 1.0)
    return drafts, torch.where(fresh[:, :, None], point, q_draft)
