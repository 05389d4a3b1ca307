"""`draft_length="calibrated"`: each row stops its chain where its expected tokens per unit of cost peak, judged
token by token from the draft's own confidence, calibrated online against what the target accepted.

The confidence stop (`"confidence"`) ends a chain after a draft token whose raw draft probability is below a fixed
threshold, and still verifies that token; the cost model (`"cost"`) picks K before the round from running
per-position acceptance, blind to which tokens the draft was sure of. On the VLM zoo's draft LM the raw probability
separates the two kinds sharply (tokens it gave >= 0.6 were accepted 99 % of the time, those below 0.3 about 5 %),
so this policy prices each drafted token by it:

* **Calibration.** A row keeps discounted counts of drafted tokens that were verified and of those accepted, in ten
  bins of raw draft probability (`[0, 0.1), ..., [0.9, 1]`); a token in bin b is accepted (given every earlier draft
  was) with `a_b = (accepted_b + n0 * m_b) / (verified_b + n0)`, the prior being `n0 = 2` pseudo-tokens at the bin's
  midpoint `m_b` (a calibrated draft's own estimate). Each round's counts decay by `decay` (0.9) first.
* **The stop, inside the round.** After drawing draft i (raw probability p_i), the row has drafted i tokens at a
  cost of `i * d` draft forwards (`draft_step_cost` = d, in one-token target forwards). Its survival is
  `S_i = a(p_1) ... a(p_i)` and verifying the i drafts yields `E_i = 1 + S_1 + ... + S_i` tokens (the bonus /
  correction included) for `c(i + 1) + i * d` (`c(m)`: a verification over m tokens, the measured `verify_costs` or
  the line `1 + v (m - 1)`, as for `"cost"`): stopping now is worth `R_stop = E_i / (c(i + 1) + i d)`. Drafting on
  is priced at the acceptance `a_top` of the row's most confident bin for every further draft,
  `R_go = max_{K > i} (E_i + S_i (a_top + ... + a_top^(K - i))) / (c(K + 1) + K d)`, and the row drafts on while
  `R_go > R_stop` (and i < `k_max`). So a confident run goes on as long as a longer verification pays, and an
  unsure draft (low `a(p_i)`, hence low `S_i`) ends the chain after it, at whatever length the costs favour.

The decision after draft i reads p_1..p_i only, and only sets whether draft i + 1 is made: a draft is never dropped
for its own probability. (Dropping the unsure last draft looks free, but it is not lossless under sampling: which
token stands at that position would then depend on its own value, and the chi-square of
`tests/drafters/test_draft_length.py` rejects the law at p ~ 1e-158; under greedy decoding it bought nothing
measurable on the zoo's templated answers either.) Only how much is proposed changes, from the draft's own
probabilities and past acceptance, never how the target accepts, so the policy is lossless like every other
(`tests/drafters/test_draft_length.py`). Every row decides on its own (per-row tensors; the batched forwards run
while any row drafts). The in-round stop reads one flag after
each draft but the last, as the confidence stop and transformers' assistant do; between rounds it reads nothing."""

import torch

from mmspec.drafters.lengths.cost import check_verify_costs, verification_costs
from mmspec.drafters.lengths.fixed import FixedLength


__all__ = ["CalibratedLength"]

BINS = 10  # raw draft probability bins of the calibration


class CalibratedLength(FixedLength):
    """Per-row in-round stop from the draft's calibrated confidence and the cost of a round (module docstring).

    Args:
        k_max: the longest chain.
        draft_step_cost: d, one draft forward's cost in one-token target forwards.
        verify_token_cost: v, each further token of a verification forward (the line `1 + v (m - 1)`).
        verify_costs: optional measured `c(1), c(2), ...` per verification width (replaces v's line).
        decay: in (0, 1]: the weight of the previous rounds' counts.
        prior_tokens: n0 > 0, each bin's prior pseudo-tokens at its midpoint.
    """

    name = "calibrated"

    def __init__(self, k_max, draft_step_cost, verify_token_cost, verify_costs=None, decay=0.9, prior_tokens=2.0):
        super().__init__(k_max)  # every row may draft k_max (`lengths()` None); the stop decides within the round
        if not (0 <= draft_step_cost and 0 <= verify_token_cost and 0 < decay <= 1 and prior_tokens > 0):
            raise ValueError(f"need costs >= 0, decay in (0, 1] and prior_tokens > 0, got {draft_step_cost}, "
                             f"{verify_token_cost}, {decay}, {prior_tokens}")  # fmt: skip
        self.d, self.v = float(draft_step_cost), float(verify_token_cost)
        self.decay, self.n0 = float(decay), float(prior_tokens)
        self.verify_costs = check_verify_costs(verify_costs)
        self.counts = None  # [B, BINS, 2] discounted (verified, accepted) drafted tokens per probability bin
        self._verify = None  # [k_max] c(K + 1) for K = 1..k_max on the rows' device
        self._round = None  # the round's per-row state between `stop` calls and `update`

    def start(self, batch, device):
        self.counts = torch.zeros(batch, BINS, 2, dtype=torch.float32, device=device)
        self._verify = torch.tensor(verification_costs(self.k_max, self.v, self.verify_costs), dtype=torch.float32,
                                    device=device)  # fmt: skip
        self._round = None

    def acceptance(self):
        """`[B, BINS]` each row's calibrated acceptance per bin of raw draft probability (module docstring)."""
        mid = (torch.arange(BINS, device=self.counts.device, dtype=torch.float32) + 0.5) / BINS
        verified, accepted = self.counts.unbind(-1)
        return (accepted + self.n0 * mid) / (verified + self.n0)

    def advance(self, step: int, prob, num_draft):
        """Fold draft `step` (0-based, raw probabilities `prob [B]`) into the round's per-row survival `S_i` and
        expected tokens `E_i` (rows still drafting only: `num_draft > step`). Returns `(i, round, drafting)`: the
        drafts made, the round's state (`survival`, `tokens` [B]) and the drafting rows."""
        if step == 0:
            ones = torch.ones(prob.shape[0], device=prob.device)
            self._round = dict(per_bin=self.acceptance(), survival=ones, tokens=ones, bins=[])
        r = self._round
        b = (prob.float() * BINS).long().clamp(0, BINS - 1)
        r["bins"].append(b)
        drafting = num_draft > step
        r["survival"] = torch.where(drafting, r["survival"] * r["per_bin"].gather(1, b[:, None])[:, 0], r["survival"])
        r["tokens"] = torch.where(drafting, r["tokens"] + r["survival"], r["tokens"])
        return step + 1, r, drafting

    def look_ahead(self, i: int):
        """For K = i + 1 .. k_max: `([B, k_max - i] a_top + ... + a_top^(K - i), [k_max - i] c(K + 1) + K d)`, the
        further tokens a surviving run would add at each row's most confident acceptance, and the round's cost."""
        ahead = torch.arange(1, self.k_max - i + 1, device=self._verify.device, dtype=torch.float32)  # K - i
        a = self._round["per_bin"][:, -1:]  # the most confident bin's acceptance
        gain = torch.where(a < 1, a * (1 - a**ahead) / (1 - a).clamp_min(1e-6), ahead)
        return gain, self._verify[i:] + (i + ahead) * self.d

    def stop(self, step: int, prob, num_draft):
        """After draft `step` (0-based) of the round with raw probabilities `prob [B]`: the rows' new `num_draft [B]`,
        `step + 1` for a row that drafts no further (module docstring); rows already stopped are kept."""
        i, r, _ = self.advance(step, prob, num_draft)
        if i >= self.k_max:
            return num_draft.clamp(max=i)
        gain, cost = self.look_ahead(i)
        stop_rate = r["tokens"] / (self._verify[i - 1] + i * self.d)
        go = (r["tokens"][:, None] + r["survival"][:, None] * gain) / cost
        return torch.where(go.max(1).values > stop_rate, num_draft, num_draft.clamp(max=i))

    def update(self, num_draft, num_accepted, finished):
        """Fold the verified drafts into each row's bins: draft j (0-based) was verified if j < num_draft and every
        earlier one was accepted (j <= num_accepted), accepted if j < num_accepted."""
        bins = torch.stack(self._round["bins"], 1)  # [B, L]
        pos = torch.arange(bins.shape[1], device=bins.device)[None]
        verified = (pos < num_draft[:, None]) & (pos <= num_accepted[:, None])
        accepted = pos < num_accepted[:, None]
        add = torch.zeros_like(self.counts)
        add[..., 0].scatter_add_(1, bins, verified.float())
        add[..., 1].scatter_add_(1, bins, (accepted & verified).float())
        self.counts = self.decay * self.counts + add

    def select_rows(self, index):
        self.counts = self.counts[index]
