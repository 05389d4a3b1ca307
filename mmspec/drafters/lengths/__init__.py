"""Draft-length policies (`mmspec.decoding.draft_length.DraftLength`), one file each, chosen by the registry's
`draft_length` knob (`mmspec.methods.DRAFT_LENGTHS`):

* `FixedLength` (`fixed.py`, `"fixed"`, the default): K = `k_max` every round.
* `HeuristicLength` (`heuristic.py`, `"heuristic"`): transformers' schedule, +2 after a fully accepted round, -1
  otherwise, per row.
* `ConfidenceStop` (`confidence.py`, `"confidence"`): a row's chain stops after an unsure draft token.
* `CostLength` (`cost.py`, `"cost"`): per row, the K maximising expected tokens per unit of cost.
* `CalibratedLength` (`calibrated.py`, `"calibrated"`): per row, a stop inside the round where the expected tokens
  per unit of cost peak, pricing each draft by its confidence calibrated online against what was accepted.
* `BatchCalibratedLength` (`batch_calibrated.py`, `"batch-calibrated"`): the calibrated stop decided once for the
  whole batch, priced at the batch's cost (a padded chain costs every row the widest K).
* `BatchCostLength` (`batch_cost.py`, `"batch-cost"`): one K for the batch, maximising the batch's expected tokens
  per unit of the batch's cost (a padded chain costs every row the widest K).

`make_draft_length(method, k_max)` builds the one a resolved `MethodSettings` names.
"""

from mmspec.drafters.lengths.batch_calibrated import BatchCalibratedLength
from mmspec.drafters.lengths.batch_cost import BatchCostLength
from mmspec.drafters.lengths.calibrated import CalibratedLength
from mmspec.drafters.lengths.confidence import ConfidenceStop
from mmspec.drafters.lengths.cost import CostLength
from mmspec.drafters.lengths.fixed import FixedLength
from mmspec.drafters.lengths.heuristic import HeuristicLength


__all__ = [
    "POLICIES",
    "BatchCalibratedLength",
    "BatchCostLength",
    "CalibratedLength",
    "ConfidenceStop",
    "CostLength",
    "FixedLength",
    "HeuristicLength",
    "make_draft_length",
]

POLICIES = {
    p.name: p
    for p in (
        FixedLength,
        HeuristicLength,
        ConfidenceStop,
        CostLength,
        BatchCostLength,
        CalibratedLength,
        BatchCalibratedLength,
    )
}


def make_draft_length(method, k_max: int):
    """The policy of a resolved `mmspec.methods.MethodSettings` (or any mapping with its draft-length knobs), with
    chains of at most `k_max` drafts."""
    name = method["draft_length"]
    if name not in POLICIES:
        raise ValueError(f"draft_length must be one of {tuple(POLICIES)}, got {name!r}")
    confidence = method["draft_confidence"]
    if name == "cost":
        return POLICIES[name](k_max, method["draft_step_cost"], method["verify_token_cost"], confidence,
                              verify_costs=method["verify_costs"])  # fmt: skip
    if name in ("calibrated", "batch-calibrated"):
        return POLICIES[name](k_max, method["draft_step_cost"], method["verify_token_cost"],
                              verify_costs=method["verify_costs"])  # fmt: skip
    if name == "batch-cost":
        return POLICIES[name](k_max, method["draft_step_cost"], method["verify_token_cost"], confidence)
    return POLICIES[name](k_max, confidence)
