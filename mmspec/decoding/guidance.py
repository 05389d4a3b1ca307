"""Classifier-free guidance row layout shared by a target and its drafters.

With guidance on (`guidance_scale != 1`) every model forward scores two streams of rows, `[cond rows; uncond rows]`
(`2B` rows; row `b` and `B + b` carry the same tokens), and a token's distribution is the guided, processed one
(`SamplingParams.probs(cond, uncond)`). With guidance off only the conditional stream is run (`B` rows): the uncond
logits would be ignored anyway.

`Guidance` also keeps device-side running sums of every distribution it made (finite iff all were), so the decoding loop checks them
once at the end (no host sync per round) and a NaN anywhere is a `ValueError` naming where it came from.
"""

import torch
from torch import Tensor

from mmspec.sampling import SamplingParams


__all__ = ["Guidance"]


class Guidance:
    """Row layout and distribution processing for one decoding call.

    Args:
        sampling: the call's `SamplingParams` (CFG scale, temperature, top-k/p, greedy), applied identically to the
            target's and the drafters' logits.
    """

    def __init__(self, sampling: SamplingParams):
        self.sampling = sampling
        self.streams = 1 if sampling.guidance_scale == 1.0 else 2
        self._sums: dict[str, Tensor] = {}  # per source: running sum of every distribution made

    @property
    def greedy(self) -> bool:
        return self.sampling.greedy

    def rows(self, x: Tensor) -> Tensor:
        """Batch items `[B, ...]` -> model rows `[streams * B, ...]` (same tokens on every stream)."""
        return x if self.streams == 1 else torch.cat([x, x], dim=0)

    def condition_rows(self, cond: Tensor, null_cond: Tensor) -> Tensor:
        """Conditions of the model rows: `cond` alone, or `[cond; null_cond]` with guidance on."""
        return cond if self.streams == 1 else torch.cat([cond, null_cond.to(device=cond.device, dtype=cond.dtype)])

    def row_index(self, index: Tensor, batch: int) -> Tensor:
        """Model rows of batch items `index [B']` when the rows hold `batch` items per stream."""
        return index if self.streams == 1 else torch.cat([index, index + batch])

    def items(self, x: Tensor) -> Tensor:
        """Model rows `[streams * B, ...]` -> the cond stream `[B, ...]` (e.g. per-item lengths)."""
        return x[: x.shape[0] // self.streams]

    def probs(self, logits: Tensor, source: str = "target", validate: bool = False) -> Tensor:
        """Model-row logits `[streams * B, ..., V]` -> processed distributions `[B, ..., V]` (float32).

        `validate=True` checks now (one host sync, e.g. at prefill); otherwise a device-side flag per `source` is
        updated and `check()` raises later.
        """
        try:
            p = self.sampling.probs(*logits.chunk(self.streams), validate=validate)
        except ValueError as err:  # name the model the logits came from
            raise ValueError(f"{source} model: {err}") from err
        if not validate:  # a sum of probabilities is finite iff every one is: one reduction, one add
            self.record(source, p.sum())
        return p

    def process(self, logits: Tensor) -> Tensor:
        """`probs(logits, validate=False)` without the running sum: a pure tensor function for a captured graph,
        which hands the sum of what it made back to `record` (a graph cannot update this object's sums)."""
        return self.sampling.probs(*logits.chunk(self.streams), validate=False)

    def record(self, source: str, total: Tensor) -> None:
        """Add `total`, a sum of distributions made from `source`'s logits, to the running sum `check` reads."""
        self._sums[source] = total if source not in self._sums else self._sums[source] + total

    def check(self) -> None:
        """Raise `ValueError` if any distribution made since the start was not finite (one host sync)."""
        if not self._sums:
            return
        names = list(self._sums)
        flags = torch.isfinite(torch.stack([self._sums[n].float() for n in names])).tolist()
        bad = [n for n, ok in zip(names, flags) if not ok]
        if bad:
            s = self.sampling
            raise ValueError(
                f"{' and '.join(bad)} logits gave non-finite probabilities (NaN in the model's logits, or overflow "
                f"with guidance_scale={s.guidance_scale}, temperature={s.temperature})"
            )
