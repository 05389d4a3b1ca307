"""Drafters: models / procedures that propose draft tokens for a target to verify (`mmspec.decoding.drafter.Drafter`).

* `ModelDrafter` (`model.py`): a small AR model of the target's family drafts a chain.
* `EagleDrafter` (`eagle.py`): an `mmspec.models.llamagen.eagle.EagleHead` drafts a sampled chain or an EAGLE-2 dynamic tree.
* `JacobiDrafter` (`jacobi.py`): the target drafts for itself (SJD window).
* `ProactiveJacobiDrafter` (`jacobi_pac.py`): the SJD window proposed as a tree plus a chain (SJD-PAC);
  `make_jacobi_drafter(vocab_size, knobs)` picks between the two from the knobs.
"""

from mmspec.decoding.drafter import Drafter, Proposal
from mmspec.drafters.eagle import DraftTree, EagleDrafter, cfg_combine, draft_chain, draft_tree
from mmspec.drafters.jacobi import JacobiDrafter
from mmspec.drafters.jacobi_pac import ProactiveJacobiDrafter, make_jacobi_drafter
from mmspec.drafters.model import ModelDrafter


__all__ = [
    "DraftTree",
    "Drafter",
    "EagleDrafter",
    "JacobiDrafter",
    "ModelDrafter",
    "ProactiveJacobiDrafter",
    "Proposal",
    "cfg_combine",
    "draft_chain",
    "draft_tree",
    "make_jacobi_drafter",
]
