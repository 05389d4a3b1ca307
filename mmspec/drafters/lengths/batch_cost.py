"""`draft_length="batch-cost"`: one K for the whole batch, the one that maximises the batch's expected tokens per
unit of the batch's cost.

In a batch every row's chain is padded to the widest row's K: the draft forwards and the verification run over the
padded width whatever each row keeps, so a row drafting less than the widest saves nothing and only gives up the
drafts it could have had accepted. The per-row cost model (`cost.py`) prices each row as if it ran alone; this
policy prices the round the batch actually pays. With each row's survival S_r(i) from the same per-row hazards as
`"cost"` (`CostLength.hazard`), every running row drafts

    W = argmax_{1 <= W <= k_max}  sum_r E_r(W) / (1 + (v_B + d) * W),   E_r(W) = 1 + S_r(1) + ... + S_r(W),

in units of a one-token target forward of the whole batch: a verification of B rows x (W + 1) tokens costs, when
a forward's cost grows linearly with its tokens (`verify_token_cost` = v per further token at one row), `1 + v_B * W`
with `v_B = v * B / (1 + v * (B - 1))` -- the same v prices a further token dearer at a larger batch (v_1 = v: at
batch 1 this is `"cost"` with the chained prior below). d (`draft_step_cost`) stays as measured at batch 1 (a
batched draft step grows with B as the target's step does). B counts the running rows; everything is computed on
the device and the width rides on the loop's one read (`mmspec.decoding.draft_length`).

The hazards use the chained prior (`CostLength(chained_prior=True)`): a position no round reached yet takes the
hazard of the deepest one reached. With the fixed prior (h = 0.2 everywhere unseen) a batch whose first width is
short never learns that longer runs pay: every row drafts the same W, so positions past W are never observed (on
the VLM zoo's templated answers, where EAGLE's first drafts are accepted ~95 % of the time, a batch of 4 stayed at
W = 1: tau 1.97 against 6.24 for a fixed chain of 6)."""

import torch

from mmspec.drafters.lengths.cost import CostLength


__all__ = ["BatchCostLength", "batch_token_cost"]


def batch_token_cost(verify_token_cost, rows):
    """`v_B`: a further token of a verification over `rows` rows, in one-token forwards of those rows (module
    docstring); `rows` a number or a tensor (>= 1)."""
    return verify_token_cost * rows / (1 + verify_token_cost * (rows - 1))


class BatchCostLength(CostLength):
    """One K per round for every running row, maximising the batch's expected tokens per unit of its cost (module
    docstring). Same arguments as `CostLength`."""

    name = "batch-cost"

    def __init__(self, k_max, draft_step_cost, verify_token_cost, confidence=None, decay=0.8, prior=(0.4, 2.0)):
        super().__init__(k_max, draft_step_cost, verify_token_cost, confidence, decay, prior, chained_prior=True)
        self.rows = 1  # rows of the call (`start`): the first K's price

    def start(self, batch, device):
        self.rows = batch  # the starting batch prices the first K (host arithmetic)
        super().start(batch, device)

    def first_token_cost(self):
        # every row at the prior's hazard: the batch's rate is B times one row's, priced at v_B
        return batch_token_cost(self.v, self.rows)

    def update(self, num_draft, num_accepted, finished):
        self.observe(num_draft, num_accepted)
        survival = (1 - self.hazard()).cumprod(-1)  # [B, k_max]
        running = ~finished
        tokens = torch.where(running[:, None], 1 + survival.cumsum(-1), 0).sum(0)  # [k_max] batch tokens at W
        rows = running.sum().clamp_min(1).to(survival.dtype)
        ks = torch.arange(1, self.k_max + 1, device=survival.device, dtype=survival.dtype)
        width = (tokens / (1 + (batch_token_cost(self.v, rows) + self.d) * ks)).argmax() + 1
        self.k = width.expand(running.shape[0]).clone()
        self._width = torch.where(running.any(), width, 0)  # 0 when every row finished (the loop stops)
