"""`draft_length="cost"`: each row drafts the K that maximises its expected tokens per unit of cost.

The model (`docs/methods.md`, "Draft length"): within a round, draft i is accepted only if drafts 1..i-1 were, and
then with probability `1 - h_i` (h_i: the row's *hazard* at position i), so the run of accepted drafts survives to
position i with `S(i) = (1 - h_1) ... (1 - h_i)` and a round of K drafts emits `E(K) = 1 + S(1) + ... + S(K)` tokens
(the bonus / correction token included). It costs `C(K) = c(K + 1) + K * d`: a verification forward over K + 1
tokens, `c(m) = 1 + v * (m - 1)` in units of a one-token target forward (`verify_token_cost` = v: the cost curve is
not flat), or the measured `c(m)` of `verify_costs` (widths past its end extend its last step), plus K draft forwards
of `draft_step_cost` = d each. The row's next K is `argmax_{1 <= K <= k_max} E(K) /
C(K)` (tokens per unit of time, the renewal-reward rate of a stream of such rounds). The hazards are running
estimates per row and position: discounted counts of the rounds that reached position i and of those rejected
there (each round: `n_i <- g * n_i + [reached i]`, `r_i <- g * r_i + [rejected at i]`, g = `decay`), `h_i = (r_i +
r0) / (n_i + n0)` with prior pseudo-counts (r0, n0) = (0.4, 2) (h = 0.2 where nothing was seen). A constant hazard
is a geometric run length (acceptance rate `1 - h` per draft); per-position hazards also capture runs that, once
started, tend to go on -- the templated stretches a drafter knows -- which a single rate would price too low.
Everything is computed on the device per row; the next width rides on the loop's one read
(`mmspec.decoding.draft_length`)."""

import torch

from mmspec.decoding.draft_length import RowLengths


__all__ = ["CostLength", "check_verify_costs", "expected_rate", "verification_costs"]


def verification_costs(k_max: int, verify_token_cost: float, verify_costs=None) -> list[float]:
    """`[c(2), ..., c(k_max + 1)]`: a verification forward's cost at each chain length K = 1..k_max (module
    docstring): the line `1 + v (m - 1)`, or the table `verify_costs` (`c(1), c(2), ...`) extended by its last step."""
    if verify_costs is None:
        return [1 + verify_token_cost * k for k in range(1, k_max + 1)]
    table = list(verify_costs)
    while len(table) < k_max + 1:
        table.append(table[-1] + (table[-1] - table[-2]))
    return table[1 : k_max + 1]


def check_verify_costs(verify_costs) -> tuple | None:
    """A policy's `verify_costs` as a tuple of floats (None stays None); at least `c(1), c(2)`, every one > 0."""
    if verify_costs is None:
        return None
    table = tuple(float(c) for c in verify_costs)
    if len(table) < 2 or min(table) <= 0:
        raise ValueError(f"verify_costs needs c(1), c(2), ... > 0, got {verify_costs}")
    return table


def expected_rate(survival, draft_step_cost: float, verify_token_cost: float, verify_costs=None):
    """`[..., k_max]` expected tokens per unit of cost `E(K) / C(K)` for K = 1..k_max, from `survival [..., k_max]`
    (`S(i)`: the probability that the first i drafts are all accepted; module docstring). `verify_costs`: the table
    (`c(1), c(2), ...`), or its `[k_max]` tensor of `verification_costs` already on `survival`'s device."""
    k_max = survival.shape[-1]
    ks = torch.arange(1, k_max + 1, device=survival.device, dtype=survival.dtype)
    if verify_costs is None:
        verify = 1 + verify_token_cost * ks
    elif torch.is_tensor(verify_costs):
        verify = verify_costs
    else:
        verify = torch.tensor(verification_costs(k_max, verify_token_cost, verify_costs), dtype=survival.dtype,
                              device=survival.device)  # fmt: skip
    return (1 + survival.cumsum(-1)) / (verify + draft_step_cost * ks)


class CostLength(RowLengths):
    """Per-row K maximising expected tokens per unit of cost (module docstring).

    Args:
        k_max: the longest chain.
        draft_step_cost: d, one draft forward's cost in one-token target forwards.
        verify_token_cost: v, each further token of a verification forward, likewise.
        verify_costs: optional measured `c(1), c(2), ...` per verification width (replaces v's line).
        confidence: optional in (0, 1): the in-round stop (`ConfidenceStop`).
        decay: g in (0, 1]: the weight of the previous rounds' counts (0.8: about the last five rounds).
        prior: (r0, n0), the pseudo-counts of rejections and of rounds at every position (0.4, 2: h = 0.2).
        chained_prior: position i's prior is position i - 1's estimate (n0 pseudo-rounds at h_{i-1}; position 1
            keeps `prior`), so positions no round reached yet take the hazard of the deepest one that was reached
            instead of the fixed prior: a policy that starts short can still learn that longer runs pay.
    """

    name = "cost"

    def __init__(self, k_max, draft_step_cost, verify_token_cost, confidence=None, decay=0.8, prior=(0.4, 2.0),
                 chained_prior=False, verify_costs=None):  # fmt: skip
        super().__init__(k_max)
        if not (0 <= draft_step_cost and 0 <= verify_token_cost and 0 < decay <= 1 and 0 <= prior[0] < prior[1]):
            raise ValueError(f"need costs >= 0, decay in (0, 1] and prior pseudo-counts 0 <= r0 < n0, got "
                             f"{draft_step_cost}, {verify_token_cost}, {decay}, {prior}")  # fmt: skip
        self.d, self.v, self.decay, self.prior = float(draft_step_cost), float(verify_token_cost), float(decay), prior
        self.confidence = confidence
        self.chained_prior = bool(chained_prior)
        self.verify_costs = check_verify_costs(verify_costs)
        self._verify = None  # the table's [k_max] tensor on the rows' device: one host-to-device copy per call
        self.counts = None

    def hazard(self):
        """`[B, k_max]` each row's running rejection probability at each draft position (given it was reached)."""
        r0, n0 = self.prior
        reached, rejected = self.counts
        if not self.chained_prior:
            return (rejected + r0) / (reached + n0)
        hazards, h = [], (rejected[:, 0] + r0) / (reached[:, 0] + n0)
        for i in range(self.k_max):  # position i's prior: n0 pseudo-rounds at position i - 1's estimate
            if i:
                h = (rejected[:, i] + n0 * h) / (reached[:, i] + n0)
            hazards.append(h)
        return torch.stack(hazards, -1)

    def best_k(self, hazard):
        survival = (1 - hazard).cumprod(-1)
        table = self.verify_costs
        if table is not None:
            if self._verify is None or self._verify.device != survival.device:
                self._verify = torch.tensor(verification_costs(self.k_max, self.v, table), dtype=survival.dtype,
                                            device=survival.device)  # fmt: skip
            table = self._verify
        return expected_rate(survival, self.d, self.v, table).argmax(-1) + 1

    def first_k(self):
        """Every row's first K, from the prior's hazard alone (host arithmetic: no tensor is read)."""
        r0, n0 = self.prior
        verify = verification_costs(self.k_max, self.first_token_cost(), self.verify_costs)
        survival, total, rates = 1.0, 1.0, []
        for k in range(1, self.k_max + 1):
            survival *= 1 - r0 / n0
            total += survival
            rates.append(total / (verify[k - 1] + self.d * k))
        return 1 + rates.index(max(rates))

    def first_token_cost(self) -> float:
        """The price of a further verified token in the first round (v; `"batch-cost"` prices it for its batch)."""
        return self.v

    def start(self, batch, device):
        super().start(batch, device)
        self.counts = torch.zeros(2, batch, self.k_max, dtype=torch.float32, device=device)  # (reached, rejected)

    def observe(self, num_draft, num_accepted):
        """Fold one verified round into the rows' discounted counts (module docstring)."""
        pos = torch.arange(self.k_max, device=num_draft.device)[None]  # draft pos + 1
        n, m = num_draft[:, None], num_accepted[:, None]
        reached = (pos <= m) & (pos < n)
        rejected = (pos == m) & (m < n)
        self.counts = self.decay * self.counts + torch.stack([reached, rejected]).to(self.counts.dtype)

    def next_k(self, num_draft, num_accepted):
        self.observe(num_draft, num_accepted)
        return self.best_k(self.hazard())

    def select_rows(self, index):
        super().select_rows(index)
        self.counts = self.counts[:, index]
