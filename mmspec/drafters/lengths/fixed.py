"""`draft_length="fixed"`: every row drafts `k_max` tokens every round (`num_draft_tokens` / `tree_depth`), the
drafting every chain drafter did before draft-length policies; with `draft_confidence` set a row also stops after
an unsure draft token (`confidence.py` is that policy by name)."""

from torch import Tensor


__all__ = ["FixedLength"]


class FixedLength:
    """K = `k_max` for every row and round (`mmspec.decoding.draft_length.DraftLength`): nothing per row, nothing to
    read; `confidence` optional in (0, 1), the in-round stop."""

    name = "fixed"

    def __init__(self, k_max: int, confidence: float | None = None):
        if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 1:
            raise ValueError(f"k_max must be an int >= 1, got {k_max!r}")
        if confidence is not None and (isinstance(confidence, bool) or not 0 < float(confidence) < 1):
            raise ValueError(f"draft_confidence must be a number in (0, 1) or None, got {confidence!r}")
        self.k_max = self.host_max = k_max
        self.confidence = None if confidence is None else float(confidence)

    def start(self, batch: int, device) -> None:
        pass

    def lengths(self) -> Tensor | None:
        return None

    def update(self, num_draft: Tensor, num_accepted: Tensor, finished: Tensor) -> None:
        pass

    def select_rows(self, index: Tensor) -> None:
        pass

    def sync_value(self) -> Tensor | None:
        return None

    def sync_host(self, value: int) -> None:
        pass
