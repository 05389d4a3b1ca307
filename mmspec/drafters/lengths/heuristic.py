"""`draft_length="heuristic"`: transformers' `num_assistant_tokens_schedule="heuristic"`, per row.

transformers (`AssistedCandidateGenerator.update_candidate_strategy`) starts from `num_assistant_tokens` and, after
each verification, adds 2 when every candidate was accepted (`num_matches == candidates`) and subtracts 1 otherwise
(never below 1). Here K starts at `k_max` (the configured length, as transformers starts at its configured
`num_assistant_tokens`), moves the same way for each row on its own acceptance, and stays within `[1, k_max]`
(transformers has no upper bound; ours is the drafter's scratch width). A chain the confidence stop shortened counts
as fully accepted when all of its drafts were, as in transformers."""

import torch

from mmspec.decoding.draft_length import RowLengths


__all__ = ["HeuristicLength"]


class HeuristicLength(RowLengths):
    """K += 2 after a row's fully accepted round, K -= 1 otherwise, within `[1, k_max]`; `confidence` optional, the
    in-round stop."""

    name = "heuristic"

    def __init__(self, k_max: int, confidence: float | None = None):
        super().__init__(k_max)
        self.confidence = confidence

    def next_k(self, num_draft, num_accepted):
        return torch.where(num_accepted >= num_draft, self.k + 2, self.k - 1)
