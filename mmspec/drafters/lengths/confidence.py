"""`draft_length="confidence"`: every row drafts up to `k_max` tokens and stops after a draft token the drafter
gave a raw (unprocessed) probability below `draft_confidence` (default 0.4) -- transformers'
`assistant_confidence_threshold` with its default. The stop reads the drafter's own distribution only, so the target's
law is untouched (lossless); it saves the draft forwards, and the verification width, that a rejection would waste.
The chain drafters apply the stop inside the round (`mmspec.drafters.chain.sample_chain`); nothing carries over
between rounds."""

from mmspec.drafters.lengths.fixed import FixedLength
from mmspec.methods import DEFAULT_DRAFT_CONFIDENCE


__all__ = ["ConfidenceStop"]


class ConfidenceStop(FixedLength):
    """Up to `k_max` drafts per row, a row's chain ending after its first draft token with a raw draft probability
    below `confidence`."""

    name = "confidence"

    def __init__(self, k_max: int, confidence: float | None = None):
        super().__init__(k_max, DEFAULT_DRAFT_CONFIDENCE if confidence is None else confidence)
