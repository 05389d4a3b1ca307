"""`draft_length="batch-calibrated"`: the calibrated stop (`calibrated.py`) decided once for the whole batch.

In a batch the chain is padded to its longest row: every draft forward and the verification run over the padded
width whatever each row keeps, so a row that stops early saves nothing while the chain goes on for another row, and
a chain that goes on for one sure row makes every row pay its width. `"calibrated"` lets each row stop on its own
and ends the chain when the last row stops; this policy prices the round the batch pays. With each row's survival
`S_r` and expected tokens `E_r` from the same calibration (`CalibratedLength`), after draft i every running row
drafts on while

    max_{K > i} sum_r (E_r + S_r (a_top,r + ... + a_top,r^(K - i))) / (c_B(K + 1) + K d)  >  sum_r E_r / (c_B(i + 1) + i d),

`c_B(m)`: a verification of the batch's rows over m tokens each, in units of the batch's one-token forward (a
`verify_costs` table measured at that batch size: `mmspec bench vlm` measures one per batch size; on the AMD EPYC
host a 4-row table is flatter than the 1-row one, 1 / 1.23 / 1.38 / 1.52 / 1.70 at widths 1-5 against 1 / 1.46 /
1.77 / 1.81 / 2.04). At batch 1 it is `"calibrated"`. A row's chain length then depends on the other rows' drafts:
still lossless (the decision after draft i reads drafts 1..i of the rows and the past only), but with per-row
generators a row's draws depend on its batch, as with `"batch-cost"`."""

import torch

from mmspec.drafters.lengths.calibrated import CalibratedLength


__all__ = ["BatchCalibratedLength"]


class BatchCalibratedLength(CalibratedLength):
    """The calibrated stop, one decision per draft for the whole batch (module docstring). Same arguments as
    `CalibratedLength`; `verify_costs` should be measured at the batch size it prices."""

    name = "batch-calibrated"

    def stop(self, step: int, prob, num_draft):
        i, r, drafting = self.advance(step, prob, num_draft)
        if i >= self.k_max:
            return num_draft.clamp(max=i)
        gain, cost = self.look_ahead(i)
        stop_rate = r["tokens"].sum() / (self._verify[i - 1] + i * self.d)
        go = (r["tokens"].sum() + torch.where(drafting[:, None], r["survival"][:, None] * gain, 0).sum(0)) / cost
        return torch.where(go.max() > stop_rate, num_draft, num_draft.clamp(max=i))
