"""mmspec: speculative decoding for multimodal generation.

The verifier core lives in `mmspec.verify` (pure, batched acceptance rules as objects) and `mmspec.sampling`
(logits -> the exact distributions samples are drawn from); the decoding engine every pipeline shares in
`mmspec.decoding` (one loop over a target adapter, a drafter and a rule) with the method registry `mmspec.methods`.
Models are in `mmspec.models`, drafters in `mmspec.drafters`, Diffusers-style pipelines in `mmspec.pipelines` and
evaluation in `mmspec.eval`.
"""

from mmspec.sampling import SamplingParams
from mmspec.stats import SpecStats
from mmspec.verify import (
    RULES,
    VerifyResult,
    get_rule,
    verify_continuous,
    verify_exact,
    verify_greedy,
    verify_grouped,
    verify_jacobi,
    verify_relaxed,
    verify_tree,
)


__version__ = "0.1.0"

__all__ = [
    "RULES",
    "SamplingParams",
    "SpecStats",
    "VerifyResult",
    "get_rule",
    "verify_continuous",
    "verify_exact",
    "verify_greedy",
    "verify_grouped",
    "verify_jacobi",
    "verify_relaxed",
    "verify_tree",
]
