"""Drafters: models / procedures that propose draft tokens for a target to verify.

* `EagleHead` (`mmspec.drafters.eagle`): EAGLE-style one-layer feature head over a LlamaGen target, with the
  EAGLE-2 dynamic tree builder `draft_tree`.
* A small-GPT draft is just a small `mmspec.models.llamagen.LlamaGenGPT` (same vocabulary and classes).
"""

from mmspec.drafters.eagle import DraftTree, EagleHead, cfg_combine, draft_tree, prepend_root


__all__ = ["DraftTree", "EagleHead", "cfg_combine", "draft_tree", "prepend_root"]
