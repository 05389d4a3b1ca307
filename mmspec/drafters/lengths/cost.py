"""`draft_length="cost"`: each row drafts the K that maximises its expected tokens per unit of cost.

The model (`docs/methods.md`, "Draft length"): a row's drafts are accepted one after another, each with the row's
acceptance rate `alpha`, until the first rejection, so a round of K drafts emits `E(K) = 1 + alpha + ... + alpha^K`
tokens (the bonus / correction token included). It costs `C(K) = c(K + 1) + K * d`: a verification forward over
K + 1 tokens, `c(m) = 1 + v * (m - 1)` in units of a one-token target forward (`verify_token_cost` = v: the cost
curve is not flat -- on the CPUs measured a 4-token verification costs 1.2-1.8x a one-token step), plus K draft
forwards of `draft_step_cost` = d each. The row's next K is `argmax_{1 <= K <= k_max} E(K) / C(K)` (tokens per unit
of time, the renewal-reward rate of a stream of such rounds). `alpha` is a running estimate per row: discounted
counts of accepted drafts `a` and rejections `f`, starting from prior pseudo-counts `(a0, f0)` (each round: `a <- g
* a + accepted`, `f <- g * f + [a draft was rejected]`, g = `decay`), `alpha = a / (a + f)` -- the maximum-likelihood
rate of a geometric run length, forgetting old rounds (and the prior) so a row follows its text (long accepted runs
in a templated answer, short ones where it turns free-form). Everything is computed on the device per row; the next width rides on
the loop's one read (`mmspec.decoding.draft_length`)."""

import torch

from mmspec.decoding.draft_length import RowLengths


__all__ = ["CostLength", "expected_rate"]


def expected_rate(alpha, k_max: int, draft_step_cost: float, verify_token_cost: float):
    """`[..., k_max]` expected tokens per unit of cost `E(K) / C(K)` for K = 1..k_max at acceptance rates `alpha
    [...]` (module docstring)."""
    ks = torch.arange(1, k_max + 1, device=alpha.device, dtype=alpha.dtype)
    powers = alpha[..., None] ** torch.arange(0, k_max + 1, device=alpha.device, dtype=alpha.dtype)  # [..., K+1]
    expected = powers.cumsum(-1)[..., 1:]  # E(K) = sum_{i <= K} alpha^i
    return expected / (1 + (verify_token_cost + draft_step_cost) * ks)


class CostLength(RowLengths):
    """Per-row K maximising expected tokens per unit of cost (module docstring).

    Args:
        k_max: the longest chain.
        draft_step_cost: d, one draft forward's cost in one-token target forwards.
        verify_token_cost: v, each further token of a verification forward, likewise.
        confidence: optional in (0, 1): the in-round stop (`ConfidenceStop`).
        decay: g in (0, 1]: the weight of the previous rounds' counts (0.5: about the last two rounds).
        prior: (a0, f0), the starting pseudo-counts of accepted and rejected drafts (4, 1: alpha starts at 0.8),
            forgotten like any round's counts.
    """

    name = "cost"

    def __init__(self, k_max, draft_step_cost, verify_token_cost, confidence=None, decay=0.5, prior=(4.0, 1.0)):
        super().__init__(k_max)
        if not (0 <= draft_step_cost and 0 <= verify_token_cost and 0 < decay <= 1 and min(prior) > 0):
            raise ValueError(f"need costs >= 0, decay in (0, 1] and a positive prior, got {draft_step_cost}, "
                             f"{verify_token_cost}, {decay}, {prior}")  # fmt: skip
        self.d, self.v, self.decay, self.prior = float(draft_step_cost), float(verify_token_cost), float(decay), prior
        self.confidence = confidence
        self.counts = None

    def best_k(self, alpha):
        return expected_rate(alpha, self.k_max, self.d, self.v).argmax(-1) + 1

    def first_k(self):
        a0, f0 = self.prior
        return int(self.best_k(torch.tensor(a0 / (a0 + f0), dtype=torch.float64)))  # a host tensor: no device read

    def start(self, batch, device):
        super().start(batch, device)
        prior = torch.tensor(self.prior, dtype=torch.float32, device=device)
        self.counts = prior[:, None].repeat(1, batch)  # discounted (accepted, rejected)

    def alpha(self):
        """`[B]` each row's running acceptance rate."""
        accepted, rejected = self.counts
        return accepted / (accepted + rejected)

    def next_k(self, num_draft, num_accepted):
        round_counts = torch.stack([num_accepted, num_accepted < num_draft]).to(self.counts.dtype)
        self.counts = self.decay * self.counts + round_counts
        return self.best_k(self.alpha())

    def select_rows(self, index):
        super().select_rows(index)
        self.counts = self.counts[:, index]
