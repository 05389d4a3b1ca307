"""Jacobi self-drafting (SJD, Teng et al., arXiv 2410.01699): the target drafts for itself.

The draft for window position j is the token the target itself sampled at j in the previous Jacobi iteration
(conditioned on the then-unverified window), with `q_draft` = that iteration's processed distribution. Positions
that have no previous sample get *fresh* initial tokens with a point-mass `q_draft`:

* `init="repeat"` (SJD's `repeat_horizon` for LlamaGen): copy the token before it in raster order, a strong prior
  on images with flat backgrounds (MNIST's black border);
* `init="random"` (SJD's default for Lumina-mGPT): a uniform random token.

Both are fixed before the target looks at the window, so a one-hot `q_draft` is exactly the law they were drawn
with given the context, as the verifier needs. The re-draft of carried positions (independent, or maximally
coupled as in SCD) is `mmspec.verify.verify_jacobi`'s job; this class only keeps the window.
"""

import torch
import torch.nn.functional as F


class JacobiDrafter:
    """Keeps the Jacobi window `[B, K]` of drafts and their `q_draft [B, K, V]` between iterations.

    Args:
        vocab_size: V.
        window: K, draft tokens per iteration (the verification forward scores `pending + K` tokens).
        init: `"repeat"` or `"random"` (see module docstring).
    """

    INITS = ("repeat", "random")

    def __init__(self, vocab_size, window, init="repeat"):
        if init not in self.INITS:
            raise ValueError(f"jacobi init must be one of {self.INITS}, got {init!r}")
        if window < 1:
            raise ValueError(f"jacobi window must be >= 1 draft token, got {window}")
        self.vocab_size, self.window, self.init = vocab_size, window, init
        self.drafts = None  # [B, K]
        self.q_draft = None  # [B, K, V]

    def reset(self, pending, generator):
        """Start a fresh window after `pending [B]` (all positions freshly initialised)."""
        b = pending.shape[0]
        self.drafts = torch.full((b, self.window), -1, dtype=torch.long, device=pending.device)
        self.q_draft = torch.zeros(b, self.window, self.vocab_size, device=pending.device)
        self._fill(pending, torch.zeros(b, dtype=torch.long, device=pending.device), generator)

    def update(self, result, pending, generator):
        """Next window from a `JacobiResult`: the carried re-drafts (left-aligned) and fresh tokens after them."""
        self.drafts = result.next_drafts.clone()
        self.q_draft = result.next_q.clone()
        self._fill(pending, result.num_carried, generator)

    def select_rows(self, index):
        """Keep only batch items `index [B']` (finished rows dropped)."""
        self.drafts, self.q_draft = self.drafts[index], self.q_draft[index]

    def narrow(self, width):
        """Keep only the first `width` window positions from now on (the image ends within them)."""
        if width < self.drafts.shape[1]:
            self.drafts, self.q_draft = self.drafts[:, :width], self.q_draft[:, :width]

    def _fill(self, pending, num_carried, generator):
        """Fill positions `>= num_carried [B]` with fresh tokens (point-mass `q_draft`)."""
        b, k = self.drafts.shape
        fresh = torch.arange(k, device=pending.device)[None, :] >= num_carried[:, None]  # [B, K]
        if self.init == "random":
            tokens = torch.randint(self.vocab_size, (b, k), generator=generator, device=pending.device)
        else:  # repeat: every fresh slot copies the last known token before the fresh run
            last_idx = (num_carried - 1).clamp(min=0)
            last_known = torch.where(num_carried > 0, self.drafts.gather(1, last_idx[:, None])[:, 0], pending)
            tokens = last_known[:, None].expand(b, k)
        self.drafts = torch.where(fresh, tokens, self.drafts)
        one_hot = F.one_hot(self.drafts.clamp(min=0), self.vocab_size).to(self.q_draft.dtype)
        self.q_draft = torch.where(fresh[:, :, None], one_hot, self.q_draft)
