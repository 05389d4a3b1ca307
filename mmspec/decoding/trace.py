"""`DecodeTrace`: where every emitted token came from.

For each output position the round it was emitted in (0 = prefill) and its origin:

* `PREFILL`   -- emitted by the prefill forward (the first token, before any draft);
* `ACCEPTED`  -- a draft token the verifier accepted;
* `RESAMPLED` -- the correction drawn from the residual after a draft was rejected;
* `BONUS`     -- drawn from `p_target` itself after every draft of the round was accepted (plain AR decoding emits
  only bonus tokens: it drafts nothing).

An acceptance map of an image is `trace.origin == ACCEPTED` reshaped to the token grid. Positions never generated
(a row that stopped at EOS) hold round -1 and origin `NONE`.
"""

from dataclasses import dataclass

import torch
from torch import Tensor


__all__ = ["ACCEPTED", "BONUS", "NONE", "ORIGINS", "PREFILL", "RESAMPLED", "DecodeTrace"]

NONE, PREFILL, ACCEPTED, RESAMPLED, BONUS = -1, 0, 1, 2, 3
ORIGINS = {PREFILL: "prefill", ACCEPTED: "accepted", RESAMPLED: "resampled", BONUS: "bonus"}


@dataclass
class DecodeTrace:
    """Per-token provenance of one decoding call.

    Attributes:
        round: `[B, N]` long, the round a token was emitted in (0 = prefill, -1 = not generated).
        origin: `[B, N]` int8, one of `PREFILL`, `ACCEPTED`, `RESAMPLED`, `BONUS` (`NONE` = not generated).
    """

    round: Tensor
    origin: Tensor

    def counts(self) -> dict[str, Tensor]:
        """Per row: tokens of each origin, `{"prefill": [B], "accepted": [B], ...}`."""
        return {name: (self.origin == code).sum(1) for code, name in ORIGINS.items()}

    def acceptance_map(self) -> Tensor:
        """`[B, N]` bool: the token was an accepted draft."""
        return self.origin == ACCEPTED

    def to(self, device) -> "DecodeTrace":
        return DecodeTrace(self.round.to(device), self.origin.to(device))

    @staticmethod
    def empty(batch: int, length: int, device=None) -> "DecodeTrace":
        return DecodeTrace(
            torch.full((batch, length), -1, dtype=torch.long, device=device),
            torch.full((batch, length), NONE, dtype=torch.int8, device=device),
        )
